"""Programs and the passes plugins register: what the lowering path, a backend and a
user's own ExecuTorch script share.

- :func:`export_model`: ``torch.export`` in eval mode under ``no_grad``, refusing state
  that export lifted as constants (:func:`check_lifted_state`).
- :func:`run_exported_passes`, :func:`as_exir_pass`, :func:`run_program_passes`: the
  registry's ``writeback_program_passes`` for a backend, each at its stage.
- :func:`write_back_positions`, :func:`write_back_bytes`: the write-back copies a graph keeps.
- :func:`decomposed`: one program's core ATen decomposition, made once and shared by
  everything asked about it (``writeback explain``'s rows and every plugin's columns).
- :func:`graphs_copy`: a copy of a program's graphs to change, sharing its weights.
- :func:`unbacked_symbols_settled`: a step that traces a program (``to_edge``,
  ``to_executorch``) leaves the program's shape environment as it found it, so the next
  step can trace the same program.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.fx.passes.infra.pass_base import PassResult

from writeback_core import meta
from writeback_core.ops import op_name, schema_of, write_back_copies
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import Registry
from writeback_core.types import ProgramPass

if TYPE_CHECKING:
    from executorch.exir import EdgeProgramManager, ExecutorchBackendConfig, ExecutorchProgramManager

    from writeback_core.types import EdgePassRun, ExportedPassRun, GraphPassRun

__all__ = [
    "MEMORY_PLANS",
    "QUANTIZED_NAMESPACE",
    "LoweringError",
    "MemoryPlan",
    "as_exir_pass",
    "backend_config",
    "check_lifted_state",
    "decomposed",
    "export_model",
    "graphs_copy",
    "initialized_buffers",
    "load_quantized_kernels",
    "own_tables",
    "run_exported_passes",
    "run_program_passes",
    "unbacked_symbols_settled",
    "write_back_bytes",
    "write_back_positions",
    "written_placeholders",
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

    Before exporting, a copy of ``module`` is called twice at the example inputs to find
    the state it carries from call to call
    (:func:`~writeback_core.carried_state.carried_states`); ``module`` is left as it was.

    :raises LoweringError: the program holds state as lifted constants (see
        :func:`check_lifted_state`): lowering it would fail or answer wrongly.
    :raises writeback_core.carried_state.StateLostError: the program drops state the
        eager module carries (see :func:`~writeback_core.carried_state.check_state_kept`).
    """
    from writeback_core.carried_state import carried_states, check_state_kept

    _eval_mode(module)
    what = name or f"module {type(module).__name__}"
    # Before exporting: a non-strict export runs forward on the module itself, and what it
    # leaves behind (a cache allocated while tracing) is not the model's state.
    # Eager PyTorch may refuse the example inputs themselves (an index out of range that the
    # program is exported to refuse at run time, as eager does): with no eager call to compare,
    # the program is exported as before and no state is checked.
    states: list[Any] | None
    try:
        with known_warnings_ignored():
            states = carried_states(module, args, kwargs)
    except Exception:  # whatever the model's forward raises at these inputs
        states = None
    with known_warnings_ignored(), torch.no_grad():
        program = torch.export.export(module, args, dict(kwargs or {}), strict=strict, dynamic_shapes=dynamic_shapes)
    check_lifted_state(program, module, what, strict)
    if states is not None:
        check_state_kept(program, states, what)
    return program


def _eval_mode(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in eval mode without grad, in place. Not chained: a PT2E-converted model
    (``allow_exported_model_train_eval``) returns ``None`` from ``eval()``."""
    module.eval()
    module.requires_grad_(False)
    return module


def _aliased_source(value: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``value`` is, through ops whose schema says their result aliases their
    first argument (views, ``alias``, ``to`` that changes nothing: ``Tensor(a) self -> Tensor(a)``)."""
    seen = 0
    while value.op == "call_function" and seen < 64:
        schema = schema_of(value.target)
        if schema is None or not schema.returns or not schema.arguments or not value.args:
            break
        returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
        source = value.args[0]
        if returned is None or first is None or returned.is_write or not isinstance(source, torch.fx.Node):
            break
        if not set(returned.before_set) & set(first.before_set):
            break
        value, seen = source, seen + 1
    return value


def written_placeholders(graph: torch.fx.Graph) -> dict[str, str]:
    """Placeholders an in-place op writes (an argument its schema marks written), directly or
    through a view or alias of them (``torch.export`` keeps a ``to`` that changes nothing as an
    alias: an ``add_`` on it writes the buffer): name -> op."""
    written: dict[str, str] = {}
    for node in graph.nodes:
        schema = schema_of(node.target) if node.op == "call_function" else None
        if schema is None:
            continue
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, torch.fx.Node):
                value = _aliased_source(value)
                if value.op == "placeholder":
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
    written = written_placeholders(program.graph_module.graph)
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
    exist, after ``config.passes``, and ``"after_out_variants"`` passes after exir's
    out-variant pass, each stage in the registry's order
    (:meth:`~writeback_core.registry.Registry.program_passes`). ``config`` is not
    changed; ``edge`` is consumed (exir edits its signature).

    :raises TypeError: a registered pass returned something exir cannot use.
    """
    _run_edge_passes(edge, registry.program_passes("edge", backend))
    _mark_user_inputs(edge)
    added: list[Any] = [as_exir_pass(p) for p in registry.program_passes("before_memory_planning", backend)]
    late = [as_exir_pass(p) for p in registry.program_passes("after_out_variants", backend)]
    changes: dict[str, Any] = {"passes": [*config.passes, *added]}
    if late:
        changes["to_out_var_pass"] = _then(config.to_out_var_pass, late)
    return edge.to_executorch(dataclasses.replace(config, **changes))


def _then(
    first: Callable[[torch.fx.GraphModule], Any], passes: Sequence[Callable[[torch.fx.GraphModule], PassResult]]
) -> Callable[[torch.fx.GraphModule], PassResult]:
    """exir's out-variant pass ``first``, then ``passes`` on its result (the
    ``"after_out_variants"`` stage)."""

    def run(gm: torch.fx.GraphModule) -> PassResult:
        result = first(gm)
        gm = getattr(result, "graph_module", gm)
        for late in passes:
            gm = late(gm).graph_module
        return PassResult(gm, True)

    return run


# One decomposition per program, dropped with the program (the key is held weakly).
_DECOMPOSED: weakref.WeakKeyDictionary[ExportedProgram, ExportedProgram] = weakref.WeakKeyDictionary()


def decomposed(program: ExportedProgram) -> ExportedProgram:
    """``program.run_decompositions()`` (core ATen), made once per program and shared.

    ``writeback explain`` finds its rows' mutations in this program, so the node names a
    :class:`~writeback_core.mutations.Mutation` carries (``value``, ``write.node``) name
    nodes of the very program a plugin gets here for its column. Every caller gets the
    same object for as long as ``program`` lives: read it, and change only a copy
    (:func:`graphs_copy`). Decomposing is the costly step of explaining (about a second for
    a small decoder, more than the columns' own work), which is why it is made once.
    """
    found = _DECOMPOSED.get(program)
    if found is None:
        with known_warnings_ignored(), unbacked_symbols_settled(program):
            found = _DECOMPOSED[program] = program.run_decompositions()
    return found


@overload
def graphs_copy(program: ExportedProgram) -> ExportedProgram: ...
@overload
def graphs_copy(program: EdgeProgramManager) -> EdgeProgramManager: ...


def graphs_copy(program: ExportedProgram | EdgeProgramManager) -> ExportedProgram | EdgeProgramManager:
    """A deep copy of ``program`` (an ``ExportedProgram`` or exir's ``EdgeProgramManager``)
    whose weights and constants are ``program``'s own tensors, not copies: graphs to change
    (``to_executorch`` changes the edge program it lowers) for the cost of the graphs alone,
    at any model size. Change no tensor of the copy in place."""
    if isinstance(program, ExportedProgram):
        programs = [program]
    else:
        programs = [program.exported_program(name) for name in program.methods]
    shared: dict[int, Any] = {}
    for one in programs:
        for tensor in (*one.state_dict.values(), *one.constants.values()):
            if isinstance(tensor, torch.Tensor):
                shared[id(tensor)] = tensor
    return copy.deepcopy(program, shared)  # ``shared`` (deepcopy's memo, which keeps every original alive) ends here


def _shape_envs(program: ExportedProgram) -> list[Any]:
    envs: dict[int, Any] = {}
    for node in program.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        fake_mode = getattr(node.meta.get("val"), "fake_mode", None)
        env = getattr(fake_mode, "shape_env", None)
        if env is not None:
            envs[id(env)] = env
    return list(envs.values())


@contextmanager
def unbacked_symbols_settled(program: ExportedProgram) -> Iterator[None]:
    """Run a step that traces ``program`` (or a copy, which shares its shape environment)
    and leave the environment's pending unbacked symbols as they were before it.

    ``torch.export`` gives a value read from a tensor (``input_pos[0].item()``, the start
    position ExecuTorch's ``llama::update_cache`` takes) a fresh unbacked symbol, which the
    trace that made it binds to a node. ``to_edge`` and ``to_executorch`` also evaluate
    such ops outside a trace (running the program on fake tensors, two per cache update
    of a decoder using ExecuTorch's custom ops), and those symbols stay pending in the
    environment the program's values share; the next trace of the same program takes
    them for its own and fails (``PendingUnbackedSymbolNotFound``). Nothing binds them
    after the step, so dropping them changes nothing a finished step produced.
    """
    saved = [(env, list(env.pending_fresh_unbacked_symbols)) for env in _shape_envs(program)]
    try:
        yield
    finally:
        for env, pending in saved:
            env.pending_fresh_unbacked_symbols[:] = pending


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
    if not found:
        return found
    import importlib

    # Always loaded: a schema registered from Python (exir registers embedding_byte.out's) lets
    # to_executorch pass, but only the library registers the kernels the runtime runs.

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
