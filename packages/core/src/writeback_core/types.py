"""The types that cross package lines through hooks. Packages never pass their own classes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args, runtime_checkable

import torch
import torch.fx
from torch import nn
from torch.export import ExportedProgram

if TYPE_CHECKING:
    from writeback_core.mutations import Dynamic, WriteShape

__all__ = [
    "NO_BACKEND",
    "AliasingEngine",
    "BackendSpec",
    "EdgePassRun",
    "EngineWrite",
    "ExportedPassRun",
    "GraphPassResult",
    "GraphPassRun",
    "LoweringError",
    "MemoryPlan",
    "ModelCase",
    "PartitionView",
    "PassRun",
    "ProgramPass",
    "RuntimeDelegate",
    "RuntimeMethod",
    "RuntimeProgram",
    "RuntimeSpec",
    "Stage",
    "StateAllocator",
]


class LoweringError(RuntimeError):
    """Export, partitioning or ``to_executorch`` failed; the message names the step.

    ``upstream`` is True when writeback had no part in it (``torch.export`` or
    ``to_edge`` failed, or the step fails without writeback's passes too), False
    when only the path with writeback's passes fails, None when not checked.
    """

    def __init__(self, message: str, upstream: bool | None = None) -> None:
        super().__init__(message)
        self.upstream = upstream


# Where a program pass runs, and what its ``run`` is handed there:
#   "exported": on the ATen ``ExportedProgram`` from ``torch.export``, before ``to_edge``
#           (a copy the lowering owns, edited in place: an :data:`ExportedPassRun`, its
#           result ignored); the graph still has its in-place ops and
#           ``scaled_dot_product_attention`` undecomposed;
#   "before_partition": on the edge ``GraphModule`` after ``to_edge``, before the
#           backend's partitioner tags it (``to_edge_transform_and_lower``'s
#           ``transform_passes``; a :data:`GraphPassRun`); the graph is functional:
#           no write-back exists yet;
#   "edge": on each method's edge ``ExportedProgram`` before ``to_executorch`` starts
#           (an :data:`EdgePassRun`, edited in place);
#   "before_memory_planning": on the ``GraphModule`` after exir inserted its
#           write-backs and before memory planning (``ExecutorchBackendConfig.passes``;
#           a :data:`GraphPassRun`);
#   "after_out_variants": on the same ``GraphModule`` once exir made every kernel call its
#           out variant (``op.out(..., out=alloc)``), just before memory planning (run after
#           ``ExecutorchBackendConfig.to_out_var_pass``; a :data:`GraphPassRun`).
Stage = Literal["exported", "before_partition", "edge", "before_memory_planning", "after_out_variants"]

# How a lowering memory plans graph inputs and outputs
# (:func:`writeback_core.lowering.backend_config`):
#   "state":     inputs unplanned (the runtime uses caller-owned state in place), outputs
#                planned. What `writeback run` ships.
#   "planned":   inputs and outputs planned (exir's default; stock runtimes copy inputs in).
#   "unplanned": neither; the caller binds outputs (``Method.set_output``).
MemoryPlan = Literal["state", "planned", "unplanned"]

# The backend name a :class:`ProgramPass` lists in ``backends`` to run when a program is
# lowered with no backend at all (no partitioner, ``lower(..., backend=None)``).
NO_BACKEND = "none"


class GraphPassResult(Protocol):
    """What a :data:`GraphPassRun` may return: torch.fx's ``PassResult``, or any report with the
    ``graph_module`` to go on with. An optional ``modified: bool`` says whether the pass changed
    it (read with a default of True)."""

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The graph module the lowering goes on with (usually the one the pass was given)."""


# A pass of stage "exported": edits the ATen program it is given; what it returns is ignored.
ExportedPassRun = Callable[[ExportedProgram], object]
# A pass of stage "edge": edits one method's edge program in place and returns it or None
# (a new program is refused: exir keeps the one it has).
EdgePassRun = Callable[[ExportedProgram], ExportedProgram | None]
# A pass of stage "before_partition" or "before_memory_planning", run by exir on a method's
# GraphModule: edits it and returns None or a GraphPassResult.
GraphPassRun = Callable[[torch.fx.GraphModule], GraphPassResult | None]
# What ``ProgramPass.run`` holds; which member applies is the pass's ``stage``'s.
PassRun = ExportedPassRun | EdgePassRun | GraphPassRun


@dataclass(frozen=True)
class BackendSpec:
    """A backend a plugin offers.

    ``name`` is what users pick (``--backend mlx``); ``backend_id`` is the
    ExecuTorch backend id its delegate blobs carry (the ``BackendDetails``
    subclass name; empty for a backend with no delegate); ``partitioner``
    builds a fresh exir ``Partitioner`` given the registry (so it can ask the
    per-mutation hook) and keyword options. ``kernel_writes``: the backend
    also answers for the state writes that run outside every partition, on
    the stock runtime's kernels (a pass may make them in place); core then
    asks ``writeback_accepts_in_place`` about each mutation no partition
    touches, with a :class:`PartitionView` of those operators whose
    ``kernels`` is True. ``dynamic_shapes``: programs lowered for the backend may
    keep dynamic dimensions (a decoder's token dimension, so that a prompt is
    prefilled in one call); ``writeback export`` exports decoders so only then.
    ``preferred``: the backend a command takes when none is named (of several
    preferred ones, the first by name; of none, the only backend installed).
    ``lowering_context``: makes a context manager that the lowering enters around
    partitioning and the delegates' ``preprocess`` (``None``: none). A backend uses it to
    make its own preprocessing cheaper; the ``.pte`` must be the same byte for byte with
    or without it, as a user's own ``to_edge_transform_and_lower`` does not enter it.
    ``single_decomposition``: the backend's partitioner filters the ops it keeps, and the
    ``.pte`` was checked to be the same byte for byte when the lowering skips exir's idle
    whole-graph retraces around the one that decomposes
    (:func:`writeback_core.decompositions.decompositions_once`); ``False``: exir's own steps.
    """

    name: str
    backend_id: str
    partitioner: Callable[..., Any]
    description: str = ""
    kernel_writes: bool = False
    dynamic_shapes: bool = False
    preferred: bool = False
    lowering_context: Callable[[], AbstractContextManager[None]] | None = None
    single_decomposition: bool = False


@dataclass(frozen=True)
class PartitionView:
    """What the per-mutation hook sees of one partition.

    ``nodes`` are the names of the nodes the partition takes; ``graph`` the
    whole graph being partitioned (read only: hookimpls must not edit it).
    ``kernels`` is True for the view of the operators outside every partition
    (run by the stock runtime's kernels), asked only for a backend whose
    ``BackendSpec.kernel_writes`` is set.
    """

    backend: str
    nodes: frozenset[str]
    graph: torch.fx.Graph = field(compare=False, repr=False)
    kernels: bool = False

    def contains(self, node: torch.fx.Node | str) -> bool:
        """Whether the partition takes ``node``."""
        name = node if isinstance(node, str) else node.name
        return name in self.nodes


@dataclass(frozen=True)
class ProgramPass:
    """A pass a plugin contributes to the pipeline at one :data:`Stage`.

    ``run`` is the function the stage hands its program (see :data:`Stage`: an
    :data:`ExportedPassRun`, an :data:`EdgePassRun` or a :data:`GraphPassRun`).

    Where and when it runs is said by name, as pytest's ``tryfirst``/``trylast`` are:

    - ``backends``: the names of the backends (``BackendSpec.name``) whose lowerings run
      it, :data:`NO_BACKEND` (``"none"``) for a lowering with no backend; ``None`` (the
      default) runs it for every backend and for none.
    - ``after`` / ``before``: names of passes of the same stage that must run before /
      after it. A name no offered pass of the stage has is an error naming this pass and
      its plugin (a misspelt name would silently order nothing), unless it is also in
      ``optional``: a relation to a pass of another plugin that may not be installed,
      ignored when it is not. A relation through a pass another backend's lowering leaves
      out still holds (``a`` before ``b`` before ``c`` keeps ``a`` before ``c`` without ``b``).
    - ``reason``: why it runs for those backends, in a few words (``writeback run`` and
      ``writeback explain`` print it beside the pass).

    Core orders the passes of a stage by these relations, ties broken by name, so
    registration order never changes the result; relations that form a cycle are
    refused (``writeback_core.pass_order.PassOrderError``).

    :raises TypeError: ``backends``, ``after``, ``before`` or ``optional`` is a single
        string (write a tuple of names), ``stage`` is no :data:`Stage`, or ``optional``
        names a pass neither ``after`` nor ``before`` names.
    """

    name: str
    stage: Stage
    run: PassRun
    _: KW_ONLY
    backends: frozenset[str] | None = None
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    reason: str = ""

    def __post_init__(self) -> None:
        if self.stage not in get_args(Stage):
            raise TypeError(
                f"pass {self.name!r}: stage {self.stage!r} is none of {', '.join(map(repr, get_args(Stage)))}"
            )
        if self.backends is not None:
            object.__setattr__(self, "backends", frozenset(_name_tuple(self.name, "backends", self.backends)))
        object.__setattr__(self, "after", _name_tuple(self.name, "after", self.after))
        object.__setattr__(self, "before", _name_tuple(self.name, "before", self.before))
        object.__setattr__(self, "optional", _name_tuple(self.name, "optional", self.optional))
        stray = [n for n in self.optional if n not in self.after and n not in self.before]
        if stray:
            raise TypeError(
                f"pass {self.name!r}: optional= names {stray[0]!r}, which neither after= nor before= names; "
                "optional= marks which of those relations may name a pass that is not installed"
            )

    def runs_for(self, backend: str | None) -> bool:
        """Whether a lowering for ``backend`` (a ``BackendSpec.name``; ``None``: no backend) runs it."""
        return self.backends is None or (backend if backend is not None else NO_BACKEND) in self.backends


def _name_tuple(program_pass: str, what: str, names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple of strings, refusing one string (``after="x"`` would be read as ``x``'s letters)."""
    if isinstance(names, str):
        raise TypeError(
            f"pass {program_pass!r}: {what}= takes a tuple of names, not the string {names!r}: "
            f"write {what}=({names!r},)"
        )
    found = tuple(names)
    odd = [n for n in found if not isinstance(n, str)]
    if odd:
        raise TypeError(f"pass {program_pass!r}: {what}= takes names (strings), got {odd[0]!r}")
    return found


@runtime_checkable
class RuntimeDelegate(Protocol):
    """A delegate written in Python that a runtime registers as an ExecuTorch backend.

    ``execute`` receives the delegate's arguments as torch tensors (zero-copy
    views of the runtime's memory) or Python scalars: first the inputs, then
    the outputs, already allocated; it writes its results into the outputs.

    It writes an input only where its lowering declared it, and nowhere else:
    an entry ``(output, input)`` of the in-place compile spec
    (``writeback_core.meta.IN_PLACE_OUTPUTS_SPEC``, read with
    ``writeback_core.blob.in_place_outputs``), or, for an aliasing engine's
    delegate, an input its ``AliasingEngine.aliased_io`` reports for the blob.
    The passes drop exactly those write-backs and keep every other (the program
    may still read an input's old value, or copy its new one back), so an
    undeclared write is a wrong answer, and a declared one left undone a stale
    state. ``init`` refuses a declaration it cannot honour (a
    ``writeback_core.blob.BlobError`` naming the entry) rather than ignore it.
    ``writeback_testing.contract.check_declared_writes`` checks a lowered
    program's delegates against this rule.

    ``init`` gets the blob as ``bytes``, or, when the delegate sets a true class
    attribute ``processed_as_memoryview``, as a read-only ``memoryview`` of the
    runtime's buffer (no copy of a large blob); that view is released when ``init``
    returns, so the delegate copies what it keeps (an array built over the view keeps
    the blob alive as long as it lives).
    """

    backend_id: str

    def init(self, processed: bytes, compile_specs: Mapping[str, bytes]) -> Any:
        """Build a handle from the delegate's processed blob."""

    def execute(self, handle: Any, args: Sequence[Any]) -> None:
        """Run once; raise to fail the call."""

    def destroy(self, handle: Any) -> None:
        """Free what ``init`` built."""


@dataclass(frozen=True)
class EngineWrite:
    """One state write as an :class:`AliasingEngine`'s predicate sees it.

    The caller derives it once, from the graph node that performs the write,
    and hands the same record to the engine whether it is predicting (before
    lowering) or lowering; an engine must decide from this record alone.

    ``write`` is core's :class:`~writeback_core.mutations.WriteShape` (dim and
    slice bounds normalized, runtime bounds as ``Dynamic``); ``shape`` the
    destination's shape; ``direct_input`` whether the destination reaches the
    engine as one of its inputs (directly, or through a copy the engine's own
    lowering removes) with no other reader of its old value; ``clamped`` whether
    a slice bound as written lay outside the destination and normalization
    clamped it (an open end ``a:`` is written as ``2**63 - 1``); ``no_alias``
    whether the write carries ``writeback_core.meta.NO_ALIAS``, which forbids
    aliasing it whatever the rule says; ``source_shape`` the shape of the value
    written (``None`` when the graph does not say), which an engine that writes the
    value's own length from the start compares with the slots the bounds name.
    """

    write: WriteShape
    shape: tuple[int | Dynamic, ...]
    direct_input: bool
    clamped: bool = False
    no_alias: bool = False
    source_shape: tuple[int | Dynamic, ...] | None = None


@runtime_checkable
class AliasingEngine(Protocol):
    """An engine that writes some state in place and recomputes the rest (TensorRT-like).

    It aliases a write (writes it into its input's memory, so no copy-back is
    needed) only when its rule allows; every other write must be copied back
    by the program.
    """

    @property
    def name(self) -> str:
        """What users pick the engine by."""

    @property
    def backend_id(self) -> str:
        """The ExecuTorch backend id its delegate blobs carry."""

    def alias_refusal(self, write: EngineWrite) -> str | None:
        """The predicate: ``None`` when the engine will alias ``write``, else why not.

        Must be the same rule the engine's lowering applies, so that a
        prediction made before lowering holds after it.
        """

    def aliased_io(self, processed: bytes) -> Mapping[str, int]:
        """What lowering really aliased: output binding -> delegate input index.

        One entry per write the engine performs in place. A binding named
        ``output<k>`` is the delegate's output ``k`` (the engine leaves it
        unwritten: the input holds the value); any other name is a write whose
        result stays inside the engine.

        :param processed: the processed blob of one lowered delegate of this engine.
        """


# Allocates caller-owned state that a backend's delegate reads and writes in
# place: ``allocator(shape, dtype)`` returns a zero-filled contiguous CPU tensor.
# Offered per backend name through ``writeback_state_allocators``.
StateAllocator = Callable[[Sequence[int], torch.dtype], torch.Tensor]


@runtime_checkable
class RuntimeMethod(Protocol):
    """One loaded method of a program, as a runtime offers it to pipelines."""

    def execute(self, inputs: Sequence[Any], clone_outputs: bool = True) -> list[Any]:
        """Run once on ``inputs`` and return every output of the method.

        The method's outputs start with one entry per mutated user input (in
        input order), then the user outputs. A mutated input must be updated in
        the caller's tensor itself. With ``clone_outputs=False`` outputs may
        alias runtime memory that the next call overwrites.
        """


@runtime_checkable
class RuntimeProgram(Protocol):
    """A loaded ``.pte`` program."""

    def load_method(self, name: str) -> RuntimeMethod:
        """Load method ``name`` (``"forward"``) with its own planned memory."""


@dataclass(frozen=True)
class RuntimeSpec:
    """A runtime a plugin offers to run ``.pte`` programs (``writeback run --runtime NAME``).

    ``load_program(data, delegates)`` registers ``delegates`` (Python runtime
    delegates keyed by backend id, as ``Registry.runtime_delegates()`` returns
    them) as ExecuTorch backends and loads the program in ``data``: the
    ``.pte`` bytes, or the path of a ``.pte`` file (a runtime may then read
    only what each method needs, when it loads). The pipeline passes the same delegate objects to every
    load of one session and reads, from any delegate that has one, the
    optional attribute ``copied_input_bytes_total: int`` (bytes the delegate
    has copied to bind inputs, over all calls) to report copies it made, and
    ``execution_paths`` (a sequence of ``str``, one per delegate instance it
    initialized, such as ``"compiled"``) to say how it runs them. ``preferred``: the
    runtime a command takes when none is named (of several preferred ones, the first
    by name; of none, the first installed by name).
    """

    name: str
    load_program: Callable[[bytes | os.PathLike[str], Mapping[str, RuntimeDelegate]], RuntimeProgram]
    description: str = ""
    preferred: bool = False


@dataclass
class ModelCase:
    """A model: how to build it, how to export it and what to feed it at call ``step``.

    The call is ``forward(*step_inputs(step), *state, **step_kwargs(step))`` where
    ``state`` is a fresh set of caller-owned state tensors from ``make_state()``
    (empty for buffer-only models). The exported program's inputs are those
    arguments flattened as ``torch.export`` flattens them (positional first, then
    keyword arguments in the order ``step_kwargs`` gives them).

    How it is exported (:func:`writeback.model_build.export_case`):

    - ``strict`` and ``dynamic_shapes`` are handed to ``torch.export.export``;
      strict export is what Hugging Face's ExecuTorch integration uses;
    - ``exported``, when given, returns an ``ExportedProgram`` the case made itself
      (its own export recipe); the pipeline takes it from there.

    ``contenders`` are other ways upstream exports the same model (for instance
    ExecuTorch's custom KV-cache ops): name -> a function returning an
    ``ExportedProgram`` that takes the same inputs. ``writeback bench`` runs each
    beside writeback's own lowering.

    ``same_inputs_every_step`` is True when the case only knows one set of example
    inputs and feeds it to every call (a model file's factory that returned
    ``(module, args)``): a decoder then writes the same position every step, and
    ``writeback run`` says so.

    ``sized``, when given, builds the same model with a K+V cache of so many MiB
    (``--cache-mib`` of ``run`` and ``bench``); a case without it has no size to set.

    ``constant_methods`` are methods of the ``.pte`` that return a constant (exir's
    ``constant_methods``): a decoder fills ExecuTorch's LLM-runner metadata here
    (``get_max_seq_len``, ``get_eos_ids``, ...; :mod:`writeback_core.llm_runner`), and every
    lowering of the case writes them.

    ``dynamic_prefill``, when given, is the same model exported with a dynamic token
    dimension (a prompt prefilled in one call; its metadata says
    ``enable_dynamic_shape``); ``writeback export`` takes it for a backend whose
    ``BackendSpec.dynamic_shapes`` is set.

    ``quantized``, when given, builds the same model with its weights quantized by the
    named scheme (``--quantize`` of ``run`` and ``export``; ``quantizations`` lists the
    schemes it takes); a case without it has nothing to quantize.

    ``all_logits``, when given, builds the same model returning every position's logits
    (``[1, n, vocab]``; ``writeback export --all-logits``): a decoder whose program returns only the
    last position's (what ExecuTorch's LLM runner reads, so a prefill of ``n`` tokens runs its LM
    head on one row and plans no ``[1, n, vocab]`` buffer) offers it for a model or tool that scores
    every position.

    ``observe``, when given, is called with ``(step, outputs)`` after each call a run makes
    (eager's outputs where the run compares, the program's where it does not): a case whose
    next inputs follow from the outputs (greedy decoding) takes them from here instead of
    running an eager copy of the model of its own.

    ``rtol``/``atol``: how far a backend's outputs and state may stray from eager's
    (``torch.allclose``). fp32 reductions in another order differ in the last bits;
    a quantized model's integer kernels round activations their own way.
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    step_inputs: Callable[[int], tuple[torch.Tensor, ...]]
    make_state: Callable[[], tuple[torch.Tensor, ...]] = field(default=lambda: ())
    step_kwargs: Callable[[int], dict[str, Any]] = field(default=lambda step: {})
    strict: bool = False
    dynamic_shapes: Any = None
    exported: Callable[[], ExportedProgram] | None = None
    contenders: Mapping[str, Callable[[], ExportedProgram]] = field(default_factory=dict)
    same_inputs_every_step: bool = False
    sized: Callable[[float], ModelCase] | None = None
    constant_methods: Mapping[str, Any] = field(default_factory=dict)
    dynamic_prefill: Callable[[], ModelCase] | None = None
    quantized: Callable[[str], ModelCase] | None = None
    quantizations: tuple[str, ...] = ()
    all_logits: Callable[[], ModelCase] | None = None
    observe: Callable[[int, Sequence[Any]], None] | None = None
    rtol: float = 1e-4
    atol: float = 1e-4

    def example_args(self, step: int = 0) -> tuple[torch.Tensor, ...]:
        """Positional arguments for ``torch.export``: the step's inputs and a fresh state."""
        return (*self.step_inputs(step), *self.make_state())

    def example_kwargs(self, step: int = 0) -> dict[str, Any]:
        """Keyword arguments for ``torch.export`` (and every call) at ``step``."""
        return dict(self.step_kwargs(step))
