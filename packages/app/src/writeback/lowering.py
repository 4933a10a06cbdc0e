"""The one lowering path: ``writeback run``, ``bench``, ``explain``, the fuzz oracle, the
contract suite and the engine targets all lower through these functions, so that what
the fuzzer certifies is byte for byte what users get.

1. :func:`export_model` (or :func:`export_case`): ``torch.export`` in eval mode under
   ``no_grad``, strict or not.
2. :func:`partition`: ``to_edge_transform_and_lower`` with the chosen backend's
   partitioner (none: plain ``to_edge``). The partitioner asks the registry per
   mutation (``writeback_accepts_in_place``) and core records the decision.
3. :func:`to_executorch`: every pass any plugin registers through
   ``writeback_program_passes`` for the backend (core orders and runs them; no plugin
   has to own the step),
   mutated buffers that start non-zero keep their initial value
   (``InitializedMutableBufferPass``; the runtimes zero-fill the others), mutable
   buffers keep their names, and graph inputs/outputs are memory planned as the
   :data:`MemoryPlan` says.
4. :func:`lower`: the three steps and serialization, with what became of each
   mutation (:class:`Lowered`).
"""

from __future__ import annotations

import copy
import ctypes
import gc
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from writeback_core.mutations import Mutation, MutationKind, find_mutations
from writeback_core.program import (
    LoweringError,
    MemoryPlan,
    as_exir_pass,
    backend_config,
    check_lifted_state,
    export_model,
    load_quantized_kernels,
    own_tables,
    run_exported_passes,
    run_program_passes,
    unbacked_symbols_settled,
    write_back_bytes,
)
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import InPlaceConflictError, InPlaceDecision, Registry, in_place_decisions
from writeback_core.types import BackendSpec, Stage

if TYPE_CHECKING:
    from executorch.exir import EdgeProgramManager, ExecutorchProgramManager
    from writeback_core.copies import CopyLeft
    from writeback_core.types import ModelCase

    from writeback.pipeline import InputSignature

__all__ = [
    "Lowered",
    "ModelBuildError",
    "Partitioned",
    "Released",
    "ReleasedError",
    "StatePlace",
    "build_case_module",
    "export_case",
    "lower",
    "partition",
    "pass_names",
    "preprocess_shares_constants",
    "state_places",
    "to_executorch",
]


class ModelBuildError(ValueError):
    """Building the model (a case's ``build()``: the user's class, a library's model) raised.

    Not a lowering failure: nothing was exported. ``model`` names the model; the message
    names it and the error; ``__cause__`` is the error itself.
    """

    def __init__(self, model: str, problem: str) -> None:
        super().__init__(
            f"model {model!r}: building the model {problem}. Nothing was exported; fix the model's code "
            "or configuration (its build() / __init__)"
        )
        self.model = model


def build_case_module(case: ModelCase) -> torch.nn.Module:
    """``case.build()``, its errors as :class:`ModelBuildError` naming the model and the error.

    :raises ModelBuildError: ``build()`` raised, or returned something else than an ``nn.Module``.
    """
    try:
        module = case.build()
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        raise ModelBuildError(case.name, f"raised {first[:300]}") from error
    if not isinstance(module, torch.nn.Module):
        raise ModelBuildError(case.name, f"returned {type(module).__name__}, not a torch.nn.Module")
    return module


def export_case(case: ModelCase) -> ExportedProgram:
    """Export a :class:`~writeback_core.types.ModelCase` as the case says: the program its
    ``exported`` returns when it gives one, else :func:`export_model` of a fresh module on
    the step-0 inputs (``example_args(0)``, ``example_kwargs(0)``) with the case's
    ``strict`` and ``dynamic_shapes``. Every command exports a case through this.

    :raises LoweringError: the program holds state as lifted constants (see
        :func:`check_lifted_state`).
    :raises TypeError: ``exported`` returned something else than an ``ExportedProgram``.
    :raises ModelBuildError: building the model raised (:func:`build_case_module`).
    """
    what = f"model {case.name!r}"
    if case.exported is not None:
        program = case.exported()
        if not isinstance(program, ExportedProgram):
            raise TypeError(
                f"{what}: its exported() returned {type(program).__name__}; it must return the "
                "torch.export.ExportedProgram of the model (or leave exported unset to let writeback export it)"
            )
        check_lifted_state(program, None, what, None)
        return program
    return export_model(
        build_case_module(case),
        case.example_args(0),
        case.example_kwargs(0),
        strict=case.strict,
        dynamic_shapes=case.dynamic_shapes,
        name=what,
    )


@dataclass
class Partitioned:
    """A program partitioned for a backend: the edge program and every in-place decision core
    recorded, keyed by target (including those of buffers that moved into a delegate, whose
    placeholders the edge program no longer has)."""

    edge: EdgeProgramManager
    decisions: dict[str, InPlaceDecision]
    mutations: list[Mutation]  # find_mutations of the edge program before any delegate took a write


def partition(
    program: ExportedProgram,
    registry: Registry | None,
    backend: BackendSpec | None,
    constant_methods: Mapping[str, Any] | None = None,
) -> Partitioned:
    """``to_edge_transform_and_lower`` of ``program`` with ``backend``'s partitioner (none: no
    delegate) inside a :class:`~writeback_core.partition.LoweringPartitioner`, which runs the
    registry's ``"exported"`` passes for the backend on a copy of the program and its
    ``"before_partition"`` passes on the edge program, and records core's decision per
    mutation a partition touches.
    ``constant_methods`` (exir's: method name -> the constant it returns) are written beside
    ``forward``.

    ``program`` is not changed. :raises LoweringError: naming the backend.
    """
    from executorch.exir import to_edge_transform_and_lower
    from writeback_core.partition import LoweringPartitioner, edge_arguments

    if backend is not None and registry is None:
        raise ValueError(f"backend {backend.name!r} needs a registry to ask per mutation")
    methods = dict(constant_methods) if constant_methods else None
    try:
        if backend is not None and registry is not None:
            # What writeback_core.to_edge_arguments() hands a user's own export script.
            arguments = edge_arguments(backend.name, backend.partitioner(registry), registry)
            with known_warnings_ignored(), preprocess_shares_constants(), unbacked_symbols_settled(program):
                edge = to_edge_transform_and_lower(program, **arguments, constant_methods=methods)
            wrapped: LoweringPartitioner = arguments["partitioner"][0]
            mutations = wrapped.mutations
            decisions = {d.target: d for d in wrapped.decisions}
        else:
            # No delegate: the passes for no backend, at the same points, without a partitioner.
            own = run_exported_passes(program, registry, None) if registry else own_tables(program)
            transforms = (
                [as_exir_pass(p) for p in registry.program_passes("before_partition", None)] if registry else []
            )
            with known_warnings_ignored(), unbacked_symbols_settled(program):
                edge = to_edge_transform_and_lower(
                    own, transform_passes=transforms or None, partitioner=[], constant_methods=methods
                )
            mutations, decisions = find_mutations(edge.exported_program()), {}
    except InPlaceConflictError:
        raise  # the plugins' disagreement, named by core: not a failure of the lowering
    except Exception as error:
        name = backend.name if backend is not None else "none"
        raise LoweringError(f"partitioning for backend {name!r} failed: {type(error).__name__}: {error}") from error
    decisions.update(in_place_decisions(edge.exported_program()))
    return Partitioned(edge, decisions, mutations)


def _copy_sharing_constants(cls: type, edge_program: ExportedProgram, compile_specs: Any) -> ExportedProgram:
    """``edge_program`` deep-copied but for its weights and constants: the copy's graph,
    signature and tables are its own, its tensors are the program's."""
    shared = {
        id(tensor): tensor
        for table in (edge_program.state_dict, edge_program.constants)
        for tensor in table.values()
        if isinstance(tensor, torch.Tensor)
    }
    return copy.deepcopy(edge_program, shared)


@contextmanager
def preprocess_shares_constants() -> Iterator[None]:
    """While the block runs, a delegate's ``preprocess`` gets a copy of its partition that
    shares the partition's weights and constants (exir's default copy clones them).

    exir hands every backend that keeps its default ``copy_exported_program_for_preprocess``
    a deep copy of each partition, all made before the first ``preprocess`` runs: on a 0.5B
    decoder lowered to XNNPACK, a second copy of every delegated weight (1.97 GB) beside the
    serialized one, which set ``writeback run``'s peak (6.44 GB; 5.58 GB sharing them). The
    copy is there so that a backend may change its graph; a backend that changes a weight
    puts a new tensor in the table (XNNPACK's passes, writeback's backends) rather than
    writing into the old one, as ExecuTorch's CUDA backend says when it shares them the same
    way in its low-memory mode. A backend that defines its own copy keeps it. The ``.pte``
    is the same byte for byte (a script lowering through ``to_edge_arguments`` writes it
    with exir's copy). Process-wide while the block runs."""
    from executorch.exir.backend.backend_details import BackendDetails

    name = "copy_exported_program_for_preprocess"
    default = BackendDetails.__dict__.get(name)
    if default is None:  # an exir without the hook copies as it does
        yield
        return
    setattr(BackendDetails, name, classmethod(_copy_sharing_constants))
    try:
        yield
    finally:
        setattr(BackendDetails, name, default)


def to_executorch(
    edge: EdgeProgramManager, registry: Registry | None, plan: MemoryPlan = "state", *, backend: str | None
) -> ExecutorchProgramManager:
    """``to_executorch`` as writeback does it (:func:`backend_config`), running the registry's
    passes for ``backend`` (the ``BackendSpec.name`` ``edge`` was partitioned for; ``None``:
    no backend), or none (``registry`` None: exir alone, the baseline a failure is triaged
    against).

    ``edge`` is consumed. :raises LoweringError: naming the plan and whether passes ran.
    """
    load_quantized_kernels(edge)
    config = backend_config(edge, plan)
    try:
        with known_warnings_ignored(), unbacked_symbols_settled(edge.exported_program()):
            if registry is None:
                return edge.to_executorch(config)
            return run_program_passes(edge, config, registry, backend)
    except Exception as error:
        raise LoweringError(
            f"to_executorch (memory plan {plan!r}, passes {'on' if registry else 'off'}) failed: "
            f"{type(error).__name__}: {error}"
        ) from error


class Released:
    """What :meth:`Lowered.release` leaves in place of the exported program, the program
    manager and the ``.pte`` bytes: any use says what happened and what to do."""

    def __init__(self, what: str) -> None:
        self._what = what

    def _refuse(self) -> ReleasedError:
        return ReleasedError(
            f"this lowering's {self._what} was released once its .pte was written and loaded "
            "(Lowered.release(), as writeback run does before its steps); read the .pte file, or lower again"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._refuse()

    def __len__(self) -> int:
        raise self._refuse()

    def __getitem__(self, key: Any) -> Any:
        raise self._refuse()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    def __bytes__(self) -> bytes:
        raise self._refuse()


class ReleasedError(RuntimeError):
    """A released :class:`Lowered`'s exported program, program manager or ``.pte`` bytes were read."""


@dataclass
class Lowered:
    """A program taken through :func:`lower`: its ``.pte`` and what became of its mutations.

    ``write_back_bytes`` maps each state still written back whole by a ``copy_`` in the
    final program to the bytes that copy moves per call; ``passes`` names the registered
    program passes that ran (empty when lowered without a registry).

    :meth:`release` drops ``exported``, ``program`` and ``pte`` (each holds the weights)
    and keeps what a report reads: the mutations and decisions, ``pte_nbytes``,
    :attr:`copies_left` and :func:`state_places`.

    The ``.pte`` stays in exir's serialized pieces until :attr:`pte` is read:
    :meth:`write_pte` writes the file from them, without the contiguous copy of the
    weights that joining them into ``bytes`` makes.
    """

    exported: ExportedProgram
    mutations: list[Mutation]
    decisions: dict[str, InPlaceDecision]
    program: ExecutorchProgramManager
    write_back_bytes: dict[str, int]
    user_input_mutations: int
    backend: str | None
    plan: MemoryPlan
    passes: tuple[str, ...]
    seconds: float
    case: ModelCase | None = None
    _after_release: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _pte: bytes | None = field(default=None, repr=False, compare=False)
    _written_nbytes: int | None = field(default=None, repr=False, compare=False)

    @property
    def pte(self) -> bytes:
        """The ``.pte`` as bytes, joined from the serialized program on the first read (a
        copy of the weights: :meth:`write_pte` writes the file without it)."""
        if self.released:
            raise Released(".pte bytes")._refuse()
        if self._pte is None:
            with known_warnings_ignored():
                self._pte = bytes(self.program.buffer)
        return self._pte

    def write_pte(self, path: Path) -> None:
        """Write the ``.pte`` to ``path``, whole or not at all (a temporary file renamed into
        place), streaming exir's serialized pieces unless :attr:`pte` was already read.

        :raises writeback._files.WriteFailed: naming ``path``.
        """
        from writeback._files import replacing

        if self.released:
            raise Released(".pte bytes")._refuse()
        with replacing(path) as temporary:
            if self._pte is not None:
                temporary.write_bytes(self._pte)
            else:
                with open(temporary, "wb") as handle, known_warnings_ignored():
                    self.program.write_to_file(handle)
            self._written_nbytes = temporary.stat().st_size

    @property
    def released(self) -> bool:
        """Whether :meth:`release` dropped the program."""
        return bool(self._after_release)

    def release(self) -> None:
        """Drop the exported program, the program manager and the ``.pte`` bytes, three
        holders of the weights, once the ``.pte`` is written and loaded: a run's steps then
        hold the runtime's copy alone. Reading any of the three afterwards raises
        :class:`ReleasedError`; ``pte_nbytes``, :attr:`copies_left` and :func:`state_places`
        and :attr:`input_signature` keep answering (worked out before the release)."""
        if self.released:
            return
        after_release = {
            "pte_nbytes": self.pte_nbytes,
            "copies_left": self.copies_left,
            "places": state_places(self),
            "input_signature": self.input_signature,
        }
        self.exported = cast("ExportedProgram", Released("exported program"))
        self.program = cast("ExecutorchProgramManager", Released("program manager"))
        self._pte = None
        self._after_release = after_release
        return_freed_memory()

    @property
    def input_signature(self) -> InputSignature:
        """What a runtime call's inputs must be, read from the exported program (after
        :meth:`release` too)."""
        from writeback.pipeline import InputSignature

        if self.released:
            return cast("InputSignature", self._after_release["input_signature"])
        return InputSignature.of(self.exported)

    @property
    def pte_nbytes(self) -> int:
        """The ``.pte``'s size in bytes (after :meth:`release` too)."""
        if self.released:
            return int(self._after_release["pte_nbytes"])
        if self._pte is None and self._written_nbytes is not None:
            return self._written_nbytes
        return len(self.pte)

    @property
    def copied_per_call(self) -> int:
        """Bytes of whole-state write-back copies the program makes every call."""
        return sum(self.write_back_bytes.values())

    @property
    def copies_left(self) -> list[CopyLeft]:
        """Each whole-state copy :attr:`write_back_bytes` counts, with its cause and what to do."""
        from writeback_core.copies import copies_left

        if self.released:
            return list(self._after_release["copies_left"])
        return copies_left(self.decisions, self.program.exported_program())

    @property
    def passes_run(self) -> bool:
        """Whether any registered program pass ran."""
        return bool(self.passes)


@dataclass(frozen=True)
class StatePlace:
    """Where one mutated state lives in a lowered program, and what writing it costs per call.

    ``owner``: ``"caller"`` (a tensor the caller passes, bound in place), ``"program"`` (a
    mutable buffer of the ``.pte``) or ``"delegate"`` (a buffer that moved inside delegate
    ``delegate``). ``delegate`` is the index of the delegate among the program's (in call
    order) that holds the state or, for a caller or program state, that writes it in place;
    ``writers`` lists every delegate the state is handed to when there are several.
    ``in_place`` is core's decision (a plugin accepted writing it in place); ``copy_bytes``
    the bytes of the whole-state write-back ``copy_`` left in the program per call (0: none)
    and ``why`` its cause (:attr:`Lowered.copies_left`).
    """

    mutation: Mutation
    owner: Literal["caller", "program", "delegate"]
    backend: str | None
    delegate: int | None
    writers: tuple[int, ...]
    in_place: bool
    copy_bytes: int
    why: str = ""


def state_places(lowered: Lowered) -> list[StatePlace]:
    """Where each of ``lowered``'s mutations lives in the final program (``find_mutations`` order).

    Read from the program itself: the delegates' own signatures (a buffer a delegate
    mutates is inside it), the arguments of each delegate call, core's recorded in-place
    decisions (:attr:`Lowered.decisions`, delegate-owned ones included) and the
    write-back copies left (:attr:`Lowered.write_back_bytes`).
    """
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    if lowered.released:
        return list(lowered._after_release["places"])
    final = lowered.program.exported_program()
    signature = final.graph_signature
    delegates = get_lowered_submodules(final.graph_module)
    inside: dict[str, int] = {}
    handed: dict[str, list[int]] = {}
    for number, (_, module, call) in enumerate(delegates):
        for target in module.original_module.graph_signature.buffers_to_mutate.values():
            inside.setdefault(target, number)
        for arg in call.args[1:]:
            if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
                handed.setdefault(arg.name, []).append(number)
    buffer_placeholders = {target: name for name, target in signature.inputs_to_buffers.items()}
    if lowered.backend is None:
        causes = {c.state: _NO_BACKEND for c in lowered.copies_left}
    else:
        causes = {c.state: c.reason for c in lowered.copies_left}
    user_inputs = list(signature.user_inputs)
    places = []
    for mutation in lowered.mutations:
        decision = lowered.decisions.get(mutation.target)
        backend = decision.backend if decision is not None else lowered.backend
        in_place = decision is not None and decision.accepted
        if mutation.kind is MutationKind.USER_INPUT:
            index = mutation.user_input_index
            placeholder = user_inputs[index] if index is not None and index < len(user_inputs) else None
            owner: Literal["caller", "program", "delegate"] = "caller"
        elif mutation.target in inside and mutation.target not in buffer_placeholders:
            places.append(StatePlace(mutation, "delegate", backend, inside[mutation.target], (), in_place, 0))
            continue
        else:
            placeholder, owner = buffer_placeholders.get(mutation.target), "program"
        writers = tuple(handed.get(placeholder, ())) if isinstance(placeholder, str) else ()
        copy = lowered.write_back_bytes.get(placeholder, 0) if isinstance(placeholder, str) else 0
        writer = writers[0] if in_place and len(writers) == 1 else None
        why = causes.get(mutation.target, "") if copy else ""
        places.append(StatePlace(mutation, owner, backend, writer, writers, in_place, copy, why))
    return places


def forget_toolchain_caches() -> None:
    """Drop what torch and exir keep of a finished lowering in process-wide caches.

    Each holds graph nodes, and through them every delegate's ``submodule_program`` with
    the weights it took, for the life of the process: torch's fake-tensor dispatch cache
    (``FakeTensorMode.cache``, keyed by the arguments of the ``executorch_call_delegate``
    calls it saw), exir's ``is_same_node`` ``lru_cache``, and the module-level
    ``WhyNoPartition`` reporters partitioners keep (the last node each rejected). On a 0.5B
    decoder they kept 1.95 GB of weights alive after :meth:`Lowered.release`. All three are
    caches or diagnostics: clearing them costs a later lowering a few cache misses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()
    try:
        from executorch.exir.backend.utils import WhyNoPartition, is_same_node
    except ImportError:  # an older exir without these helpers keeps nothing of them
        return
    is_same_node.cache_clear()
    for name, module in list(sys.modules.items()):
        if not name.startswith("executorch.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, WhyNoPartition):
                value.node = None


def return_freed_memory() -> None:
    """Drop the toolchain's caches of finished lowerings (:func:`forget_toolchain_caches`),
    collect cyclic garbage now and, with glibc, hand the freed heap back to the system
    (``malloc_trim``): a program's graph copies are cycles the collector may otherwise keep
    until the next large allocation, and glibc keeps freed pages for reuse in fragments."""
    forget_toolchain_caches()
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return
    trim(0)


_NO_BACKEND = "no backend was chosen, so no plugin decided (the portable backend runs the same kernels in place)"


def lower(
    exported: ExportedProgram,
    registry: Registry | None,
    backend: BackendSpec | None = None,
    plan: MemoryPlan = "state",
    case: ModelCase | None = None,
    constant_methods: Mapping[str, Any] | None = None,
) -> Lowered:
    """Partition ``exported`` for ``backend``, run the registry's passes, serialize.

    ``constant_methods`` (default: ``case``'s) are methods of the ``.pte`` returning a
    constant, exir's ``constant_methods``: ExecuTorch's LLM runner reads its metadata so.

    ``exported`` is not changed. :raises LoweringError: a step failed; the message names it.
    """
    start = time.perf_counter()
    if constant_methods is None and case is not None:
        constant_methods = case.constant_methods
    partitioned = partition(exported, registry, backend, constant_methods)
    # The partitioner's working copies are cyclic garbage: freed here, before serialization
    # copies the weights, they do not add to the lowering's peak.
    return_freed_memory()
    name = backend.name if backend is not None else None
    program = to_executorch(partitioned.edge, registry, plan, backend=name)
    final = program.exported_program()
    signature = final.graph_signature
    return Lowered(
        exported=exported,
        mutations=partitioned.mutations,
        decisions=partitioned.decisions,
        program=program,
        write_back_bytes=write_back_bytes(final),
        user_input_mutations=sum(1 for s in signature.output_specs if s.kind is OutputKind.USER_INPUT_MUTATION),
        backend=name,
        plan=plan,
        passes=pass_names(registry, name),
        seconds=time.perf_counter() - start,
        case=case,
    )


def pass_names(registry: Registry | None, backend: str | None) -> tuple[str, ...]:
    """Names of the program passes a lowering for ``backend`` (a ``BackendSpec.name``;
    ``None``: no backend) runs with ``registry``, stage by stage, in order."""
    if registry is None:
        return ()
    return tuple(p.name for stage in get_args(Stage) for p in registry.program_passes(stage, backend))
