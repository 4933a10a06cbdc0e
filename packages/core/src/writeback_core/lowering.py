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
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx.passes.infra.pass_base import PassResult

from writeback_core import meta
from writeback_core.mutations import Mutation, MutationKind, find_mutations
from writeback_core.ops import op_name, schema_of, write_back_copies
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import InPlaceConflictError, InPlaceDecision, Registry, in_place_decisions
from writeback_core.types import BackendSpec, ProgramPass, Stage

if TYPE_CHECKING:
    from executorch.exir import EdgeProgramManager, ExecutorchBackendConfig, ExecutorchProgramManager

    from writeback_core.copies import CopyLeft
    from writeback_core.pipeline import InputSignature
    from writeback_core.types import EdgePassRun, ExportedPassRun, GraphPassRun
    from writeback_core.zoo import ModelCase

__all__ = [
    "MEMORY_PLANS",
    "Lowered",
    "LoweringError",
    "MemoryPlan",
    "ModelBuildError",
    "Partitioned",
    "Released",
    "ReleasedError",
    "StatePlace",
    "as_exir_pass",
    "backend_config",
    "build_case_module",
    "check_lifted_state",
    "export_case",
    "export_model",
    "initialized_buffers",
    "load_quantized_kernels",
    "lower",
    "partition",
    "pass_names",
    "run_exported_passes",
    "run_program_passes",
    "state_places",
    "to_executorch",
    "write_back_bytes",
    "write_back_positions",
]

# How graph inputs and outputs are memory planned:
#   "state":     inputs unplanned (the runtime uses caller-owned state in place), outputs
#                planned. What `writeback run` ships.
#   "planned":   inputs and outputs planned (exir's default; stock runtimes copy inputs in).
#   "unplanned": neither; the caller binds outputs (``Method.set_output``).
MemoryPlan = Literal["state", "planned", "unplanned"]
MEMORY_PLANS: Mapping[MemoryPlan, tuple[bool, bool]] = {
    "state": (False, True),
    "planned": (True, True),
    "unplanned": (False, False),
}


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


class LoweringError(RuntimeError):
    """Export, partitioning or ``to_executorch`` failed; the message names the step.

    ``upstream`` is True when writeback had no part in it (``torch.export`` or
    ``to_edge`` failed, or the step fails without writeback's passes too), False
    when only the path with writeback's passes fails, None when not checked.
    """

    def __init__(self, message: str, upstream: bool | None = None) -> None:
        super().__init__(message)
        self.upstream = upstream


def export_model(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
    dynamic_shapes: Any = None,
    name: str | None = None,
) -> ExportedProgram:
    """``torch.export.export`` of ``module`` in eval mode, without grad, quietly.

    The one export helper of writeback: every command and test harness exports
    through it, so they all see the same graph. ``name`` (the model's) is what an
    error names; default: the module's class.

    :raises LoweringError: the program holds state as lifted constants (see
        :func:`check_lifted_state`): lowering it would fail or answer wrongly.
    """
    _eval_mode(module)
    with known_warnings_ignored(), torch.no_grad():
        program = torch.export.export(module, args, dict(kwargs or {}), strict=strict, dynamic_shapes=dynamic_shapes)
    check_lifted_state(program, module, name or f"module {type(module).__name__}", strict)
    return program


def _eval_mode(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in eval mode without grad, in place. Not chained: a PT2E-converted model
    (``allow_exported_model_train_eval``) returns ``None`` from ``eval()``."""
    module.eval()
    module.requires_grad_(False)
    return module


def export_case(case: ModelCase) -> ExportedProgram:
    """Export a :class:`~writeback_core.zoo.ModelCase` as the case says: the program its
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


def _written_placeholders(graph: torch.fx.Graph) -> dict[str, str]:
    """Placeholders an in-place op writes (an argument its schema marks written): name -> op."""
    written: dict[str, str] = {}
    for node in graph.nodes:
        schema = schema_of(node.target) if node.op == "call_function" else None
        if schema is None:
            continue
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, torch.fx.Node) and value.op == "placeholder":
                written.setdefault(value.name, op_name(node.target))
    return written


def _storage(tensor: Any) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr()) if isinstance(tensor, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):  # a tensor without real storage (fake, meta)
        return None


def check_lifted_state(
    program: ExportedProgram, module: torch.nn.Module | None, what: str, strict: bool | None
) -> None:
    """Refuse a program that holds the model's state as lifted tensor constants.

    Non-strict ``torch.export`` lifts a tensor that ``forward`` reaches other than as a
    registered buffer (a list of cache tensors, as Hugging Face's ``StaticCache`` keeps
    them) as a constant, even when it shares storage with a registered buffer. Writes to
    it are then no buffer mutation: the state would never persist (or lowering fails
    deep in AOTAutograd, ``expected compiled_fn to be GraphModule``), and a constant that
    aliases a buffer is a stale copy of it in the ``.pte``.

    :param module: the exported module, whose buffers the constants are checked
        against (``None``: only writes to constants are looked for).
    :param what: what the error names (``model 'name'``).
    :param strict: how the program was exported (``None``: not known), for the advice.
    :raises LoweringError: a lifted constant is written by the graph or shares storage
        with a registered buffer; the message names each and what to do.
    """
    lifted = program.graph_signature.inputs_to_lifted_tensor_constants
    if not lifted:
        return
    written = _written_placeholders(program.graph_module.graph)
    buffers: dict[int, str] = {}
    if module is not None:
        for buffer_name, buffer in module.named_buffers(remove_duplicate=False):
            pointer = _storage(buffer)
            if pointer is not None and pointer != 0:
                buffers.setdefault(pointer, buffer_name)
    problems = []
    for placeholder, constant in lifted.items():
        reasons = []
        if placeholder in written:
            reasons.append(f"written by {written[placeholder]}")
        shared = buffers.get(_storage(program.constants.get(constant)) or 0)
        if shared is not None:
            reasons.append(f"shares storage with registered buffer {shared!r}")
        if reasons:
            problems.append(f"{constant} ({', '.join(reasons)})")
    if not problems:
        return
    advice = (
        "export strictly: strict=True (ModelCase(strict=True, ...), as Hugging Face's ExecuTorch integration does)"
        if strict is not True
        else "the export was strict already"
    )
    raise LoweringError(
        f"{what}: torch.export lifted tensors of the model's state as constants, not buffers: "
        f"{'; '.join(problems)}. Writes to them would not persist across calls (to_edge fails in AOTAutograd). "
        f"Fix: {advice}, or register those tensors as buffers of the module (register_buffer) and "
        "have forward write the buffers themselves.",
        upstream=True,
    )


@dataclass
class Partitioned:
    """A program partitioned for a backend: the edge program and every in-place decision core
    recorded, keyed by target (including those of buffers that moved into a delegate, whose
    placeholders the edge program no longer has)."""

    edge: EdgeProgramManager
    decisions: dict[str, InPlaceDecision]


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
            with known_warnings_ignored():
                edge = to_edge_transform_and_lower(program, **arguments, constant_methods=methods)
            wrapped: LoweringPartitioner | None = arguments["partitioner"][0]
        else:
            # No delegate: the passes for no backend, at the same points, without a partitioner.
            own = run_exported_passes(program, registry, None) if registry else own_tables(program)
            transforms = (
                [as_exir_pass(p) for p in registry.program_passes("before_partition", None)] if registry else []
            )
            with known_warnings_ignored():
                edge = to_edge_transform_and_lower(
                    own, transform_passes=transforms or None, partitioner=[], constant_methods=methods
                )
            wrapped = None
    except InPlaceConflictError:
        raise  # the plugins' disagreement, named by core: not a failure of the lowering
    except Exception as error:
        name = backend.name if backend is not None else "none"
        raise LoweringError(f"partitioning for backend {name!r} failed: {type(error).__name__}: {error}") from error
    decisions = {d.target: d for d in wrapped.decisions} if wrapped is not None else {}
    decisions.update(in_place_decisions(edge.exported_program()))
    return Partitioned(edge, decisions)


def own_tables(program: ExportedProgram) -> ExportedProgram:
    """``program`` over a graph and dicts of constants and weights of its own (the tensors
    are shared), without the weights, buffers and constants nothing reads.

    exir's edge program keeps the very ``constants`` dict of the program it was made
    from, and lowering a delegate deletes from it the constants the delegate took
    (a Llama mask, RoPE tables): the caller's program would lose them, and a second
    lowering of it (a stock contender in ``writeback bench``) would fail. An unread
    constant (each ExecuTorch Llama layer keeps a RoPE table the model never reads)
    would otherwise stay in the ``.pte`` beside the delegate's copy of the one it reads.
    """
    from torch.export.graph_signature import ExportGraphSignature, InputKind

    graph_module = copy.deepcopy(program.graph_module)
    signature = program.graph_signature
    placeholders = {n.name: n for n in graph_module.graph.nodes if n.op == "placeholder"}
    mutated = set(signature.buffers_to_mutate.values())
    state_dict, constants = dict(program.state_dict), dict(program.constants)
    kept = []
    for spec in signature.input_specs:
        node = placeholders.get(getattr(spec.arg, "name", ""))
        unread = (
            spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
            and node is not None
            and not node.users
            and spec.target not in mutated
        )
        if not unread:
            kept.append(spec)
            continue
        assert node is not None and spec.target is not None
        graph_module.graph.erase_node(node)
        state_dict.pop(spec.target, None)
        constants.pop(spec.target, None)
    graph_module.recompile()
    return ExportedProgram(
        root=graph_module,
        graph=graph_module.graph,
        graph_signature=ExportGraphSignature(input_specs=kept, output_specs=list(signature.output_specs)),
        state_dict=state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=constants,
        verifiers=program.verifiers,
    )


def run_exported_passes(program: ExportedProgram, registry: Registry, backend: str | None) -> ExportedProgram:
    """A copy of ``program`` (:func:`own_tables`; ``program`` is not changed) with the
    registry's ``"exported"`` passes for ``backend`` run on it, in order."""
    own = own_tables(program)
    for program_pass in registry.program_passes("exported", backend):
        cast("ExportedPassRun", program_pass.run)(own)
    return own


def as_exir_pass(program_pass: ProgramPass) -> Callable[[torch.fx.GraphModule], PassResult]:
    """Adapt a ``"before_partition"`` or ``"before_memory_planning"`` pass (its ``run`` a
    :data:`~writeback_core.types.GraphPassRun`) to exir's contract (always a ``PassResult``)."""
    run_pass = cast("GraphPassRun", program_pass.run)

    def run(gm: torch.fx.GraphModule) -> PassResult:
        result = run_pass(gm)
        if result is None:
            return PassResult(gm, True)
        out = getattr(result, "graph_module", None)
        if not isinstance(out, torch.fx.GraphModule):
            raise TypeError(
                f"pass {program_pass.name!r} returned {type(result).__name__}; a "
                "'before_memory_planning' pass must return None or an object with a "
                "'graph_module' (such as torch.fx PassResult)"
            )
        return PassResult(out, bool(getattr(result, "modified", True)))

    run.__name__ = program_pass.name
    return run


def _run_edge_passes(edge: EdgeProgramManager, passes: Sequence[ProgramPass]) -> None:
    for method in edge.methods:
        program = edge.exported_program(method)
        for program_pass in passes:
            result = cast("EdgePassRun", program_pass.run)(program)
            if result is not None and result is not program:
                raise TypeError(
                    f"'edge' pass {program_pass.name!r} returned a new program for method "
                    f"{method!r}; edge passes run in place, so the pass must edit the program "
                    "it is given and return it or None"
                )


def _mark_user_inputs(edge: EdgeProgramManager) -> None:
    """Record on each user-input placeholder that it is one: passes inside exir see only a
    ``GraphModule``, without the signature that tells inputs from buffers."""
    for method in edge.methods:
        program = edge.exported_program(method)
        user_inputs = set(program.graph_signature.user_inputs)
        for node in program.graph_module.graph.nodes:
            if node.op == "placeholder" and node.name in user_inputs:
                meta.set_custom(node, meta.USER_INPUT, True)


def run_program_passes(
    edge: EdgeProgramManager, config: ExecutorchBackendConfig, registry: Registry, backend: str | None
) -> ExecutorchProgramManager:
    """``edge.to_executorch(config)`` with every pass the registry offers for ``backend`` (the
    one ``edge`` was partitioned for; ``None``: no backend), at its stage.

    ``"edge"`` passes run first, in place on each method's edge program;
    ``"before_memory_planning"`` passes run inside exir after its write-back copies
    exist, after ``config.passes``, in the registry's order
    (:meth:`~writeback_core.registry.Registry.program_passes`). ``config`` is not
    changed; ``edge`` is consumed (exir edits its signature).

    :raises TypeError: a registered pass returned something exir cannot use.
    """
    _run_edge_passes(edge, registry.program_passes("edge", backend))
    _mark_user_inputs(edge)
    added: list[Any] = [as_exir_pass(p) for p in registry.program_passes("before_memory_planning", backend)]
    return edge.to_executorch(dataclasses.replace(config, passes=[*config.passes, *added]))


def initialized_buffers(program: ExportedProgram) -> list[str]:
    """Placeholder names of the mutated buffers whose initial value is not all zeros.

    The runtimes zero-fill a mutable buffer that carries no data, so only these need
    their value in the ``.pte``.
    """
    signature = program.graph_signature
    mutated = set(signature.buffers_to_mutate.values())
    found = []
    for placeholder, target in signature.inputs_to_buffers.items():
        if target not in mutated:
            continue
        value = program.state_dict.get(target, program.constants.get(target))
        if isinstance(value, torch.Tensor) and bool(value.ne(0).any()):
            found.append(placeholder)
    return found


def backend_config(edge: EdgeProgramManager, plan: MemoryPlan = "state") -> ExecutorchBackendConfig:
    """The ``ExecutorchBackendConfig`` writeback lowers with: named mutable buffers, non-zero
    initial values kept (:func:`initialized_buffers`), inputs/outputs planned per ``plan``."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    if plan not in MEMORY_PLANS:
        raise ValueError(f"memory plan must be one of {sorted(MEMORY_PLANS)}, got {plan!r}")
    inputs, outputs = MEMORY_PLANS[plan]
    names = sorted({n for m in edge.methods for n in initialized_buffers(edge.exported_program(m))})
    return ExecutorchBackendConfig(
        emit_mutable_buffer_names=True,
        passes=[InitializedMutableBufferPass(names)] if names else [],
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=inputs, alloc_graph_output=outputs),
    )


# The namespace of PT2E's quantize/dequantize ops, whose out variants ExecuTorch ships in a
# library of its own (``executorch.kernels.quantized``), not loaded by ``import executorch``.
QUANTIZED_NAMESPACE = "quantized_decomposed"


def _quantized_ops(edge: EdgeProgramManager) -> list[str]:
    found = set()
    for method in edge.methods:
        for node in edge.exported_program(method).graph_module.graph.nodes:
            schema = schema_of(node.target) if node.op == "call_function" else None
            if schema is not None and schema.name.startswith(QUANTIZED_NAMESPACE + "::"):
                found.add(schema.name)
    return sorted(found)


def load_quantized_kernels(edge: EdgeProgramManager) -> list[str]:
    """Load ExecuTorch's quantized kernels when ``edge`` runs ``quantized_decomposed`` ops
    outside any delegate (a PT2E-quantized model on no backend): without them
    ``to_executorch`` stops at "Missing out variants". Returns the ops found (empty: nothing
    loaded).

    :raises LoweringError: the ops are there and the kernels cannot be loaded; the message
        names the ops and what to install.
    """
    found = _quantized_ops(edge)
    if not found or _has_out_variant(found[0]):
        return found
    import importlib

    importlib.import_module("executorch.kernels.quantized")  # loads the library; logs, never raises
    if not _has_out_variant(found[0]):
        raise LoweringError(
            f"the program runs {', '.join(found)} outside any delegate, and ExecuTorch's quantized kernels "
            "(executorch.kernels.quantized, libquantized_ops_aot_lib) could not be loaded: install an executorch "
            "wheel that ships them, or lower to a backend that takes the quantized ops"
        )
    return found


def _has_out_variant(name: str) -> bool:
    """Whether an out variant (an overload named ``out`` or ``..._out``) of schema name
    ``namespace::op`` is registered."""
    schemas = torch._C._jit_get_schemas_for_operator(name)
    return any(s.overload_name == "out" or s.overload_name.endswith("_out") for s in schemas)


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
        with known_warnings_ignored():
            if registry is None:
                return edge.to_executorch(config)
            return run_program_passes(edge, config, registry, backend)
    except Exception as error:
        raise LoweringError(
            f"to_executorch (memory plan {plan!r}, passes {'on' if registry else 'off'}) failed: "
            f"{type(error).__name__}: {error}"
        ) from error


def write_back_positions(graph: torch.fx.Graph) -> dict[str, tuple[int, int, int]]:
    """For each write-back ``copy_(placeholder, value)``: ``(copy index, value index, count)``.

    Indices count the graph's ``call_function`` nodes; keys are placeholder names.
    The one "find the write-back copies" helper.
    """
    calls = [n for n in graph.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(calls)}
    found: dict[str, tuple[int, int, int]] = {}
    for node in write_back_copies(graph):
        if len(node.args) < 2:
            continue
        value = node.args[1]
        value_index = index.get(value, -1) if isinstance(value, torch.fx.Node) else -1
        found[str(node.args[0])] = (index[node], value_index, len(calls))
    return found


def write_back_bytes(program: ExportedProgram) -> dict[str, int]:
    """Bytes per call of each write-back ``copy_`` into a placeholder, keyed by placeholder."""
    graph = program.graph_module.graph
    by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    found: dict[str, int] = {}
    for name in write_back_positions(graph):
        val = by_name[name].meta.get("val")
        if isinstance(val, torch.Tensor):
            found[name] = val.numel() * val.element_size()
    return found


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
    """

    exported: ExportedProgram
    mutations: list[Mutation]
    decisions: dict[str, InPlaceDecision]
    program: ExecutorchProgramManager
    pte: bytes
    write_back_bytes: dict[str, int]
    user_input_mutations: int
    backend: str | None
    plan: MemoryPlan
    passes: tuple[str, ...]
    seconds: float
    case: ModelCase | None = None
    _kept: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` dropped the program."""
        return bool(self._kept)

    def release(self) -> None:
        """Drop the exported program, the program manager and the ``.pte`` bytes, three
        holders of the weights, once the ``.pte`` is written and loaded: a run's steps then
        hold the runtime's copy alone. Reading any of the three afterwards raises
        :class:`ReleasedError`; ``pte_nbytes``, :attr:`copies_left` and :func:`state_places`
        and :attr:`input_signature` keep answering (worked out before the release)."""
        if self.released:
            return
        kept = {
            "pte_nbytes": len(self.pte),
            "copies_left": self.copies_left,
            "places": state_places(self),
            "input_signature": self.input_signature,
        }
        self.exported = cast("ExportedProgram", Released("exported program"))
        self.program = cast("ExecutorchProgramManager", Released("program manager"))
        self.pte = cast("bytes", Released(".pte bytes"))
        self._kept = kept

    @property
    def input_signature(self) -> InputSignature:
        """What a runtime call's inputs must be, read from the exported program (after
        :meth:`release` too)."""
        from writeback_core.pipeline import InputSignature

        if self.released:
            return cast("InputSignature", self._kept["input_signature"])
        return InputSignature.of(self.exported)

    @property
    def pte_nbytes(self) -> int:
        """The ``.pte``'s size in bytes (after :meth:`release` too)."""
        if self.released:
            return int(self._kept["pte_nbytes"])
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
            return list(self._kept["copies_left"])
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
        return list(lowered._kept["places"])
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
    with known_warnings_ignored():
        mutations = find_mutations(exported.run_decompositions())
    if constant_methods is None and case is not None:
        constant_methods = case.constant_methods
    partitioned = partition(exported, registry, backend, constant_methods)
    name = backend.name if backend is not None else None
    program = to_executorch(partitioned.edge, registry, plan, backend=name)
    final = program.exported_program()
    signature = final.graph_signature
    return Lowered(
        exported=exported,
        mutations=mutations,
        decisions=partitioned.decisions,
        program=program,
        pte=bytes(program.buffer),
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
