"""The writeback pipeline, assembled from whatever the registry offers, and a session
stepping a lowered program beside eager PyTorch.

The one lowering path (:mod:`writeback_core.lowering`: partition with the backend's
partitioner, every registered program pass for that backend, ``to_executorch``,
``.pte``; :func:`lower_case` exports a case and takes it there), then a runtime, with caller-owned state allocated
by the backend's allocator and bound in place. Core names no backend, runtime
or pass: each comes from a hook (``writeback_backends``,
``writeback_program_passes``, ``writeback_runtimes``,
``writeback_state_allocators``, ``writeback_runtime_delegates``).

What this module guarantees:

1. Caller-owned state (the inputs a model mutates) is left out of memory
   planning (``MemoryPlanningPass(alloc_graph_input=False)``), so the runtime
   uses the caller's tensor itself; it is allocated with the backend's
   allocator when one is offered, else with ``torch.zeros``.
2. Every copy of whole state the program still performs per call is counted:
   the write-back ``copy_`` nodes left in the final program (static), and the
   bytes a delegate reports it copied to bind its inputs (dynamic, read from
   the optional ``copied_input_bytes_total`` attribute of a runtime delegate).
3. A step's inputs reach the runtime flattened as ``torch.export`` flattened the
   example inputs (:func:`flatten_step_inputs`: positional, then keyword
   arguments), and eager gets the same call; a step whose inputs do not fit the
   exported program is refused naming the model, the step and the input.
4. :func:`compare` compares one step with eager PyTorch, outputs and
   caller-owned state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ConstantArgument, TensorArgument
from torch.utils import _pytree as pytree
from writeback_core.lowered import InputSignature, Lowered
from writeback_core.lowering import Partitioned, lower, partition
from writeback_core.mutations import Mutation, MutationKind
from writeback_core.registry import Registry
from writeback_core.types import BackendSpec, ModelCase, RuntimeDelegate, RuntimeMethod, RuntimeSpec, StateAllocator

from writeback.model_build import ModelBuildError, build_case_module, export_case
from writeback.reference import Float64Check

__all__ = [
    "ATOL",
    "RTOL",
    "Eager",
    "Pipeline",
    "PipelineError",
    "Session",
    "StepCheck",
    "StepInputError",
    "StepResult",
    "assemble",
    "choose_backend",
    "compare",
    "flatten_step_inputs",
    "lower_case",
    "state_nbytes",
]

# Tolerances of the eager comparison: fp32 reductions in another order (MLX,
# ExecuTorch's portable kernels) differ from PyTorch's in the last bits.
RTOL = 1e-4
ATOL = 1e-4


class PipelineError(RuntimeError):
    """The registry cannot assemble the pipeline asked for (a backend or runtime is missing)."""


@dataclass(frozen=True)
class Pipeline:
    """What the registry offers for one run: a backend (or none: no delegate), a runtime,
    the delegates that runtime registers, and the state allocator."""

    registry: Registry
    backend: BackendSpec | None
    runtime: RuntimeSpec
    delegates: Mapping[str, RuntimeDelegate]
    allocator: StateAllocator | None

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """Caller-owned state shaped like ``like``, holding its values, from the backend's allocator."""
        if self.allocator is None:
            tensor = torch.zeros(like.shape, dtype=like.dtype)
        else:
            tensor = self.allocator(tuple(like.shape), like.dtype)
        tensor.copy_(like)
        return tensor


def choose_backend(registry: Registry, backend: str | None = None) -> BackendSpec | None:
    """The backend ``backend`` names among those the registry offers (see :func:`assemble`).

    :raises PipelineError: the name is not offered; the message lists what is.
    """
    backends = registry.backends()
    if backend is None:
        preferred = [backends[name] for name in sorted(backends) if backends[name].preferred]
        return preferred[0] if preferred else (next(iter(backends.values())) if len(backends) == 1 else None)
    if backend == "none":
        return None
    if backend in backends:
        return backends[backend]
    raise PipelineError(
        f"no backend named {backend!r}; installed plugins offer: "
        f"{', '.join(sorted(backends)) or 'none'} (or 'none' for no delegate)"
    )


def assemble(registry: Registry, backend: str | None = None, runtime: str | None = None) -> Pipeline:
    """Pick a backend and a runtime among those the registry offers.

    :param backend: a backend name, ``"none"`` for no delegate (everything runs on
        ExecuTorch's kernels), or ``None`` for the default: the backend that says it is
        ``preferred`` (``BackendSpec.preferred``; of several, the first by name), else the
        only backend offered, else none.
    :param runtime: a runtime name, or ``None`` for the default: the ``preferred`` one
        (``RuntimeSpec.preferred``; of several, the first by name), else the first by name.
    :raises PipelineError: the name is not offered; the message lists what is.
    """
    spec = choose_backend(registry, backend)
    runtimes = registry.runtimes()
    if not runtimes:
        raise PipelineError("no plugin offers a runtime (hook writeback_runtimes); install writeback-pybind-runtime")
    if runtime is None:
        preferred = [runtimes[name] for name in sorted(runtimes) if runtimes[name].preferred]
        chosen = preferred[0] if preferred else runtimes[sorted(runtimes)[0]]
    elif runtime in runtimes:
        chosen = runtimes[runtime]
    else:
        raise PipelineError(f"no runtime named {runtime!r}; installed plugins offer: {', '.join(sorted(runtimes))}")
    allocator = registry.state_allocators().get(spec.name) if spec is not None else None
    return Pipeline(registry, spec, chosen, registry.runtime_delegates(), allocator)


def lower_case(
    case: ModelCase,
    pipeline: Pipeline,
    *,
    between_steps: Callable[[], None] | None = None,
    partitioned: Callable[[ExportedProgram, Partitioned], None] | None = None,
) -> Lowered:
    """Export ``case`` (:func:`~writeback.model_build.export_case`) and take it through the one
    lowering path (:func:`writeback_core.lowering.lower`) with the pipeline's backend,
    caller-owned state left out of the memory plan. ``between_steps``: the command's
    housekeeping between partitioning and serialization (see ``lower``). ``partitioned``,
    when given, is called with the exported program and the partitioned one before
    ``between_steps`` (``writeback run`` computes eager's steps there, then frees the weights
    the delegates took).

    :raises PipelineError: export, the backend's partitioner or the passes fail; the
        message names the model and the backend.
    :raises ModelBuildError: building the model raised (the model's error, not a lowering's).
    """
    try:
        if partitioned is None:
            return lower(
                export_case(case), pipeline.registry, pipeline.backend, "state", case, between_steps=between_steps
            )
        start = time.perf_counter()
        exported = export_case(case)
        parts = partition(exported, pipeline.registry, pipeline.backend, case.constant_methods)
        called = time.perf_counter()
        partitioned(exported, parts)
        start += time.perf_counter() - called  # the caller's work is no part of the lowering's time
        lowered = lower(
            exported, pipeline.registry, pipeline.backend, "state", case, partitioned=parts, between_steps=between_steps
        )
        lowered.seconds = time.perf_counter() - start
        return lowered
    except ModelBuildError:
        raise  # the model's own error, not the lowering's: the CLI reports it as the user's
    except Exception as error:
        backend = pipeline.backend.name if pipeline.backend else "none"
        raise PipelineError(
            f"lowering model {case.name!r} to backend {backend!r} failed: {type(error).__name__}: {error}"
        ) from error


class StepInputError(ValueError):
    """A step's inputs do not fit the exported program: another structure, keyword, shape,
    dtype, or another value of an input ``torch.export`` baked in as a constant."""


def _describe_leaf(path: tuple[Any, ...], positional: int) -> str:
    """``step input 1``, ``state 0``, ``keyword 'cache_position'`` (with any nested path)."""
    head = path[:2]
    if len(head) == 2 and isinstance(head[0], pytree.SequenceKey) and head[0].idx == 0:
        index = head[1].idx if isinstance(head[1], pytree.SequenceKey) else -1
        where = f"step input {index}" if index < positional else f"state {index - positional}"
        return where + pytree.keystr(tuple(path[2:]))
    if len(head) == 2 and isinstance(head[1], pytree.MappingKey):
        return f"keyword {head[1].key!r}" + pytree.keystr(tuple(path[2:]))
    return "input " + pytree.keystr(tuple(path))


def _spec_text(spec: pytree.TreeSpec | None) -> str:
    return " ".join(str(spec).split())


def _ordered_kwargs(spec: pytree.TreeSpec | None, kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """``kwargs`` in the order the program's in_spec keeps them (exported keyword order)."""
    if spec is None or spec.type is not tuple or spec.num_children != 2:
        if kwargs:
            raise StepInputError(f"{where}: keyword arguments {sorted(kwargs)} given, the program takes none")
        return kwargs
    keys = list(spec.child(1).context or [])
    missing, extra = [k for k in keys if k not in kwargs], sorted(set(kwargs) - set(keys))
    if missing or extra:
        raise StepInputError(
            f"{where}: the program was exported with keyword arguments {keys}; this step's step_kwargs "
            f"{'lacks ' + str(missing) if missing else ''}{' and ' if missing and extra else ''}"
            f"{'adds ' + str(extra) if extra else ''}. Give every step the same keywords."
        )
    return {k: kwargs[k] for k in keys}


def flatten_step_inputs(
    program: ExportedProgram | InputSignature, case: ModelCase, step: int, state: Sequence[torch.Tensor]
) -> list[Any]:
    """The runtime inputs of call ``step``: ``((*case.step_inputs(step), *state),
    case.example_kwargs(step))`` flattened as ``torch.export`` flattened the example inputs
    (``program.call_spec.in_spec``), keyword arguments in the exported order.

    The ``state`` tensors are in the list themselves (not copies), so a runtime binds the
    caller's memory. Every input is checked against the program's: a tensor's dtype and
    static dimensions, and the value of a non-tensor input ``torch.export`` specialized.
    A caller flattening many steps passes the program's :class:`InputSignature`, read once.

    :raises StepInputError: the step's inputs do not fit; the message names the model, the
        step, the input, what the program expects and what the step gave.
    """
    signature = program if isinstance(program, InputSignature) else InputSignature.of(program)
    where = f"model {case.name!r}, step {step}"
    positional = case.step_inputs(step)
    spec = signature.in_spec
    kwargs = _ordered_kwargs(spec, case.example_kwargs(step), where)
    leaves_with_paths, got = pytree.tree_flatten_with_path(((*positional, *state), kwargs))
    if spec is not None and got != spec:
        raise StepInputError(
            f"{where}: the inputs (step_inputs, then the state, then step_kwargs) have the structure "
            f"{_spec_text(got)}, the program was exported with {_spec_text(spec)}. "
            "Give every step inputs of the same structure as step 0."
        )
    for (path, leaf), arg in zip(leaves_with_paths, signature.user, strict=False):
        problem = _leaf_problem(leaf, arg, signature.placeholders)
        if problem is not None:
            raise StepInputError(f"{where}: {_describe_leaf(path, len(positional))} {problem}")
    return [leaf for _, leaf in leaves_with_paths]


def _leaf_problem(leaf: Any, arg: Any, placeholders: Mapping[str, torch.fx.Node]) -> str | None:
    """Why ``leaf`` cannot be the program input ``arg``, or ``None`` when it fits."""
    if isinstance(arg, ConstantArgument):
        if isinstance(leaf, torch.Tensor) or leaf != arg.value:
            return (
                f"is {leaf!r}; the program was exported with the constant {arg.value!r} (torch.export "
                "bakes a non-tensor input into the program). Pass it as a tensor to vary it."
            )
        return None
    if not isinstance(arg, TensorArgument):
        return None
    if not isinstance(leaf, torch.Tensor):
        return f"is {type(leaf).__name__}; the program takes a tensor there"
    node = placeholders.get(arg.name)
    val = node.meta.get("val") if node is not None else None
    if not isinstance(val, torch.Tensor):
        return None
    expected = tuple(d if isinstance(d, int) else None for d in val.shape)
    fits = len(expected) == leaf.dim() and all(e in (None, a) for e, a in zip(expected, leaf.shape, strict=True))
    if fits and leaf.dtype == val.dtype:
        return None
    shown = tuple("*" if e is None else e for e in expected)
    return (
        f"is {leaf.dtype} {tuple(leaf.shape)}; the program was exported for {val.dtype} {shown} "
        "(* = dynamic). Give that step inputs like step 0's, or export with dynamic_shapes."
    )


@dataclass(frozen=True)
class StepResult:
    """One call through the runtime: its latency, its user outputs and the bytes it copied.

    ``copied_bytes`` = the program's whole-state write-backs per call plus
    ``delegate_copied_bytes``, what delegates reported copying to bind inputs.
    """

    step: int
    seconds: float
    outputs: list[Any]
    copied_bytes: int
    delegate_copied_bytes: int


def _delegate_copies(delegates: Mapping[str, RuntimeDelegate]) -> int:
    total = 0
    for delegate in delegates.values():
        counter = getattr(delegate, "copied_input_bytes_total", None)
        if isinstance(counter, int):
            total += counter
    return total


@dataclass
class Session:
    """A lowered program loaded in the pipeline's runtime, with its caller-owned state.

    ``state`` holds the model's caller-owned state tensors (allocated by the
    backend's allocator), bound in place on every call.
    """

    pipeline: Pipeline
    lowered: Lowered
    method: RuntimeMethod
    state: tuple[torch.Tensor, ...]
    case: ModelCase
    _inputs: list[Any] = field(default_factory=list)
    _signature: InputSignature | None = None

    @classmethod
    def open(
        cls, pipeline: Pipeline, lowered: Lowered, case: ModelCase | None = None, path: Path | None = None
    ) -> Session:
        """Load the ``.pte`` in the pipeline's runtime and allocate the state of ``case``
        (default: the case ``lowered`` was made from).

        :param path: where ``lowered.pte`` was written: the runtime loads that file, so it
            need not copy the bytes (writeback's runtime reads a delegate's data when the
            method loads and frees it once the delegate has taken it)."""
        case = case if case is not None else lowered.case
        if case is None:
            raise ValueError("this program was lowered without a ModelCase: pass case= to Session.open")
        program = pipeline.runtime.load_program(lowered.pte if path is None else path, pipeline.delegates)
        method = program.load_method("forward")
        state = tuple(pipeline.allocate(t) for t in case.make_state())
        return cls(pipeline, lowered, method, state, case, _signature=lowered.input_signature)

    def step(self, step: int) -> StepResult:
        """Run decode step ``step``: the case's inputs for that step, the state, the step's
        keyword arguments, flattened by :func:`flatten_step_inputs`.

        :raises StepInputError: the step's inputs do not fit the exported program.
        """
        if self._signature is None:
            self._signature = self.lowered.input_signature
        inputs = flatten_step_inputs(self._signature, self.case, step, self.state)
        before = _delegate_copies(self.pipeline.delegates)
        start = time.perf_counter()
        outputs = self.method.execute(inputs, clone_outputs=False)
        seconds = time.perf_counter() - start
        # Keep the inputs alive until the next call: a runtime may hold their pointers.
        self._inputs = inputs
        copied = _delegate_copies(self.pipeline.delegates) - before
        user = [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs[self.lowered.user_input_mutations :]]
        return StepResult(step, seconds, user, self.lowered.copied_per_call + copied, copied)


@dataclass(frozen=True)
class StepCheck:
    """How far one step is from eager: the largest absolute error of outputs and of state,
    and what differed beyond the fixed tolerance (empty when the step matches it). ``float64``:
    the step judged against float64 eager when the fixed tolerance refused it
    (:mod:`writeback.reference`); it then decides."""

    output_error: float
    state_error: float | None
    problems: tuple[str, ...]
    float64: Float64Check | None = None

    @property
    def ok(self) -> bool:
        if self.problems and self.float64 is not None:
            return self.float64.ok
        return not self.problems


class Eager:
    """The same model in eager PyTorch, stepped alongside, with its own copy of the state."""

    def __init__(self, case: ModelCase, module: torch.nn.Module | None = None) -> None:
        """``module``: the model to step (one the caller built, say the very one exported);
        default: a new ``case.build()``."""
        self.case = case
        self.module = module if module is not None else build_case_module(case)
        self.module.eval()  # not chained: a PT2E-converted model's eval() returns None
        self.module.requires_grad_(False)
        self.state = case.make_state()

    def step(self, step: int) -> list[Any]:
        """Run eager step ``step`` (``forward(*step_inputs, *state, **step_kwargs)``); returns the
        flattened outputs."""
        with torch.no_grad():
            return pytree.tree_leaves(
                self.module(*self.case.step_inputs(step), *self.state, **self.case.example_kwargs(step))
            )


def _max_error(actual: Any, expected: Any) -> float:
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        return 0.0 if actual == expected else float("inf")
    if actual.shape != expected.shape:
        return float("inf")
    if actual.numel() == 0:
        return 0.0
    return float((actual.double() - expected.double()).abs().max())


def _close(actual: Any, expected: Any, rtol: float, atol: float) -> bool:
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        return bool(actual == expected)
    if actual.shape != expected.shape:
        return False
    return bool(torch.allclose(actual.to(expected.dtype), expected, rtol=rtol, atol=atol))


def compare(
    result: StepResult,
    eager_outputs: Sequence[Any],
    state: Sequence[torch.Tensor],
    eager_state: Sequence[torch.Tensor],
    rtol: float = RTOL,
    atol: float = ATOL,
) -> StepCheck:
    """Compare one step's outputs and state with eager's (``torch.allclose`` at ``rtol``/``atol``;
    a case's own are :attr:`ModelCase.rtol <writeback_core.types.ModelCase.rtol>` and ``atol``)."""
    problems: list[str] = []
    if len(result.outputs) != len(eager_outputs):
        problems.append(f"the program returned {len(result.outputs)} outputs, eager {len(eager_outputs)}")
    out_error = 0.0
    for index, (mine, theirs) in enumerate(zip(result.outputs, eager_outputs, strict=False)):
        error = _max_error(mine, theirs)
        out_error = max(out_error, error)
        if not _close(mine, theirs, rtol, atol):
            shape = tuple(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
            problems.append(f"output {index} {shape} differs from eager by {error:.3g}")
    state_error: float | None = None
    for index, (mine, theirs) in enumerate(zip(state, eager_state, strict=True)):
        error = _max_error(mine, theirs)
        state_error = max(state_error or 0.0, error)
        if not _close(mine, theirs, rtol, atol):
            problems.append(f"state {index} {tuple(mine.shape)} differs from eager by {error:.3g}")
    return StepCheck(out_error, state_error, tuple(problems))


def state_nbytes(mutations: Sequence[Mutation]) -> tuple[int, int]:
    """``(caller-owned, program-owned)`` bytes of the mutated state, from the mutations."""
    caller = sum(m.nbytes or 0 for m in mutations if m.kind is MutationKind.USER_INPUT)
    owned = sum(m.nbytes or 0 for m in mutations if m.kind is not MutationKind.USER_INPUT)
    return caller, owned
