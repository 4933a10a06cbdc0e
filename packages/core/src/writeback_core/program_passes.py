"""The passes plugins register, run on a program at their stages, and the program helpers
they and the lowering path share (:mod:`writeback_core.lowering` runs them; a backend and a
user's own ExecuTorch script may too).

- :func:`run_exported_passes`, :func:`as_exir_pass`, :func:`run_program_passes`: the
  registry's ``writeback_program_passes`` for a backend, each at its stage.
- :func:`own_tables`: a program over tables of its own, without what nothing reads.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast, overload

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.fx.passes.infra.pass_base import PassResult

from writeback_core import meta
from writeback_core.ops import write_back_copies
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import Registry
from writeback_core.types import ProgramPass

if TYPE_CHECKING:
    from executorch.exir import EdgeProgramManager, ExecutorchBackendConfig, ExecutorchProgramManager

    from writeback_core.types import EdgePassRun, ExportedPassRun, GraphPassRun

__all__ = [
    "as_exir_pass",
    "decomposed",
    "graphs_copy",
    "own_tables",
    "run_exported_passes",
    "run_program_passes",
    "unbacked_symbols_settled",
    "write_back_bytes",
    "write_back_positions",
]


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
