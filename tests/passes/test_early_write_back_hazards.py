"""Every hazard the seed thread's reviews named, each a test named after it.

Each runtime test lowers a small model through ``writeback_passes.to_executorch``
(real export, real exir, real memory planning) and runs it in stock
``executorch.runtime`` for several calls against eager PyTorch. Each of these
models is miscompiled if the rule it pins is removed from the pass (checked by
hand: removing the rule turns the test red).
"""

from __future__ import annotations

import sys

import pytest
import torch
import writeback_passes
from executorch.exir import ExecutorchBackendConfig
from executorch.exir.dialects._ops import ops
from torch.export.graph_signature import InputKind
from writeback_passes import insert_write_back_early

from .hazard_models import (
    NoPlaceholder,
    OldReadAfterNew,
    ReadThroughView,
    SharedAllocation,
    Stateless,
    ValueAliasesEarlierBuffer,
    ValueAliasesOtherBuffer,
    seeded,
)
from .lowering import assert_runs_like_eager, call_positions, edge_of, export_module, lower


def _inputs(step: int) -> tuple[torch.Tensor, ...]:
    return (seeded(100 + step, 16),)


def _index(names: list[str], name: str) -> int:
    return names.index(name)


def _copy_of(program, state: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(copy index, value index) among call_function nodes for the write-back of ``state``."""
    graph = program.exported_program().graph
    calls = [n for n in graph.nodes if n.op == "call_function"]
    for i, node in enumerate(calls):
        if node.target is torch.ops.aten.copy_.default and node.args[0].name == state:
            return i, calls.index(node.args[1]) if node.args[1] in calls else -1
    raise AssertionError(f"no write-back of {state}")


def test_old_value_read_after_new_value_is_computed_keeps_copy_after_the_read() -> None:
    program = lower(OldReadAfterNew(), _inputs(0))
    calls = call_positions(program)
    copy, value = _copy_of(program, "b_state")
    # The read of the old state is the multiply by 3 of the state placeholder.
    graph = program.exported_program().graph
    readers = [
        calls.index(u.name)
        for u in graph.find_nodes(op="placeholder", target="b_state")[0].users
        if u.op == "call_function" and u.target is not torch.ops.aten.copy_.default
    ]
    assert readers and copy > max(readers) > value
    assert_runs_like_eager(program, OldReadAfterNew(), _inputs)


def test_read_through_view_of_buffer_keeps_copy_after_the_view_reader() -> None:
    program = lower(ReadThroughView(), _inputs(0))
    graph = program.exported_program().graph
    # exir has turned the view_copy into a real view of the state by now.
    view = next(
        n
        for n in graph.nodes
        if n.op == "call_function"
        and n.args
        and getattr(n.args[0], "name", "") == "b_state"
        and n.target is not torch.ops.aten.copy_.default
    )
    calls = call_positions(program)
    copy, _ = _copy_of(program, "b_state")
    view_readers = [calls.index(u.name) for u in view.users]
    assert copy > max(view_readers)
    assert_runs_like_eager(program, ReadThroughView(), _inputs)


def test_value_aliasing_other_buffer_falls_back_to_end_in_original_order() -> None:
    edge = edge_of(ValueAliasesOtherBuffer(), _inputs(0))
    results = []

    def spy(gm):  # type: ignore[no-untyped-def]
        results.append(insert_write_back_early(gm))
        return results[-1]

    from writeback_core import ProgramPass, hookimpl, load_registry

    class Only:
        writeback_name = "only-early"

        @hookimpl
        def writeback_program_passes(self, stage):  # type: ignore[no-untyped-def]
            return [ProgramPass("spy", stage, spy)] if stage == "before_memory_planning" else []

    program = writeback_passes.to_executorch(
        edge,
        ExecutorchBackendConfig(emit_mutable_buffer_names=True),
        registry=load_registry(entry_points=False, plugins=[Only()]),
    )
    (result,) = results
    assert result.fallback is not None
    assert result.placements == ()
    calls = call_positions(program)
    copy_a, _ = _copy_of(program, "b_a")
    copy_b, _ = _copy_of(program, "b_b")
    # Both copies last, ``a`` (first in the signature) first.
    assert (copy_a, copy_b) == (len(calls) - 2, len(calls) - 1)
    assert_runs_like_eager(program, ValueAliasesOtherBuffer(), _inputs)


def test_value_aliasing_a_buffer_copied_earlier_is_moved_ahead_in_the_fallback() -> None:
    """exir orders the copies b, a; ``a``'s value is a view of ``b``, so stock gives ``a`` the new
    ``b``. The fallback keeps both copies last but puts ``a``'s first."""
    stock = lower(ValueAliasesEarlierBuffer(), _inputs(0), early=False)
    with pytest.raises(AssertionError, match="call 0 a"):
        assert_runs_like_eager(stock, ValueAliasesEarlierBuffer(), _inputs, calls=1)
    program = lower(ValueAliasesEarlierBuffer(), _inputs(0))
    calls = call_positions(program)
    copy_a, _ = _copy_of(program, "b_a")
    copy_b, _ = _copy_of(program, "b_b")
    assert (copy_a, copy_b) == (len(calls) - 2, len(calls) - 1)
    assert_runs_like_eager(program, ValueAliasesEarlierBuffer(), _inputs)


def test_share_allocation_annotation_of_reinplace_counts_as_alias() -> None:
    # exir's reinplace pass has no in-place slice_scatter, so it only annotates the
    # node to share the state's allocation (``_share_alloc_with_arg_idx``).
    config = {"reinplace_extra_ops": frozenset({ops.edge.aten.slice_scatter.default})}
    program = lower(SharedAllocation(), _inputs(0), **config)
    graph = program.exported_program().graph
    shared = [n for n in graph.nodes if n.meta.get("_share_alloc_with_arg_idx") is not None]
    assert [n.name for n in shared] == ["aten_slice_scatter_default"]
    calls = call_positions(program)
    copy, _ = _copy_of(program, "b_state")
    readers = [calls.index(u.name) for u in shared[0].users if u.op == "call_function"]
    assert copy > max(readers)
    assert_runs_like_eager(program, SharedAllocation(), _inputs, **{})


def test_no_placeholder_graph_is_left_alone() -> None:
    program = export_module(NoPlaceholder(), ())
    edge_ep = edge_of(NoPlaceholder(), ()).exported_program()
    for ep in (program, edge_ep):
        assert not [n for n in ep.graph.nodes if n.op == "placeholder"]
        before = [n.name for n in ep.graph.nodes]
        result = insert_write_back_early(ep)
        assert (result.analysed, result.placements, result.modified) == (False, (), False)
        assert [n.name for n in ep.graph.nodes] == before
    lowered = lower(NoPlaceholder(), ())
    assert_runs_like_eager(lowered, NoPlaceholder(), lambda step: ())


def _alias_analyses_built(run) -> int:  # type: ignore[no-untyped-def]
    """How many ``AliasAnalysis`` objects ``run()`` builds, observed with a profiler hook."""
    from writeback_core import AliasAnalysis

    init = AliasAnalysis.__init__.__code__
    count = 0

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal count
        if event == "call" and frame.f_code is init:
            count += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count


def test_nothing_to_write_back_changes_nothing_and_builds_no_analysis() -> None:
    edge = edge_of(Stateless(), _inputs(0))
    gm = edge.exported_program().graph_module
    from executorch.exir.passes.insert_write_back_for_buffers_pass import (
        insert_write_back_for_buffers_pass,
    )

    insert_write_back_for_buffers_pass(edge.exported_program())
    before = [(n.name, n.target, n.args) for n in gm.graph.nodes]
    results = []
    assert _alias_analyses_built(lambda: results.append(insert_write_back_early(gm))) == 0
    assert [(n.name, n.target, n.args) for n in gm.graph.nodes] == before
    assert (results[0].analysed, results[0].modified) == (False, False)
    # The observer does see an analysis when there is something to write back.
    stateful = edge_of(OldReadAfterNew(), _inputs(0)).exported_program()
    assert _alias_analyses_built(lambda: insert_write_back_early(stateful)) == 1
    assert_runs_like_eager(lower(Stateless(), _inputs(0)), Stateless(), _inputs)


# --- custom ops: the runtime has no kernel for them, so these run the graph in Python ---


@torch.library.custom_op("wbtest::sneaky_scale", mutates_args=())
def sneaky_scale(x: torch.Tensor) -> torch.Tensor:
    """Claims (schema ``(Tensor x) -> Tensor``) not to write ``x`` but doubles it in place."""
    x.mul_(2)
    return x.sum().reshape(1)


@sneaky_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1)


@torch.library.custom_op("wbtest::bump_", mutates_args=("x",))
def bump_(x: torch.Tensor) -> None:
    """Adds one to ``x`` in place; its schema says so (``Tensor(a!) x``)."""
    x.add_(1)


@bump_.register_fake
def _(x: torch.Tensor) -> None:
    return None


class SneakyWrite(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = x * 2 + self.state
        total = torch.ops.wbtest.sneaky_scale(new)
        self.state.copy_(new)
        return total + 1


class MutatedAfterComputed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = x * 2 + self.state
        out = torch.sin(x)
        torch.ops.wbtest.bump_(new)
        self.state.copy_(new)
        return out


def _run_graph(ep, module: torch.nn.Module, calls: int = 4) -> None:  # type: ignore[no-untyped-def]
    """Run ``ep``'s graph module in Python, threading real buffer tensors, against eager."""
    state = {fqn: b.clone() for fqn, b in module.named_buffers()}
    params = dict(module.named_parameters())
    eager = type(module)()
    for call in range(calls):
        (x,) = _inputs(call)
        args = []
        for spec in ep.graph_signature.input_specs:
            if spec.kind is InputKind.BUFFER:
                args.append(state[spec.target])
            elif spec.kind is InputKind.PARAMETER:
                args.append(params[spec.target])
            elif spec.kind is InputKind.CONSTANT_TENSOR:
                args.append(ep.constants[spec.target])
            else:
                args.append(x.clone())
        with torch.no_grad():
            expected = eager(x.clone())
            outputs = ep.graph_module(*args)
        torch.testing.assert_close(outputs[-1], expected, msg=f"call {call} output")
        for fqn, value in eager.named_buffers():
            torch.testing.assert_close(state[fqn], value, msg=f"call {call} {fqn}")


def _aten_program(module: torch.nn.Module):  # type: ignore[no-untyped-def]
    return export_module(module, _inputs(0)).run_decompositions()


def test_custom_op_with_schema_but_no_alias_annotation_is_assumed_to_write() -> None:
    ep = _aten_program(SneakyWrite())
    result = insert_write_back_early(ep)
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    names = [n.name for n in calls]
    sneaky = next(n.name for n in calls if "sneaky_scale" in str(n.target))
    (placed,) = result.placements
    assert _index(names, placed.copy) > _index(names, sneaky) > _index(names, placed.value)
    _run_graph(ep, SneakyWrite())


def test_value_mutated_in_place_after_it_is_computed_keeps_copy_after_the_mutation() -> None:
    from torch.export._remove_auto_functionalized_pass import unsafe_remove_auto_functionalized_pass

    # exir does this inside to_executorch before inserting write-backs: the
    # functionalized custom op becomes an in-place call on the value again.
    ep = unsafe_remove_auto_functionalized_pass(_aten_program(MutatedAfterComputed()))
    bump = next(n for n in ep.graph.nodes if "bump_" in str(n.target))
    result = insert_write_back_early(ep)
    (placed,) = result.placements
    names = [n.name for n in ep.graph.nodes]
    value = names.index(placed.value)
    assert bump.args[0].name == placed.value
    assert names.index(placed.copy) == names.index(bump.name) + 1 > value + 1
    _run_graph(ep, MutatedAfterComputed())


def test_user_input_written_back_early_keeps_its_planned_slot_to_the_end() -> None:
    """exir's planner skips the in-place ``copy_`` when computing lifetimes; the pass returns the
    caller's placeholder so the input's slot is not handed to later temporaries."""

    from writeback.zoo import builtin_models

    case = builtin_models()["decoder-caller-cache"]
    program = lower(case.build(), case.example_args(0))
    graph = program.exported_program().graph
    nodes = list(graph.nodes)
    for name in ("caches_0", "caches_1"):
        placeholder = nodes[[n.name for n in nodes].index(name)]
        copy = next(u for u in placeholder.users if u.target is torch.ops.aten.copy_.default)
        assert nodes.index(copy) < len(nodes) // 2  # moved well before the end
        assert placeholder in graph.output_node().all_input_nodes
        assert placeholder.meta["spec"].lifetime[1] == len(nodes) - 1  # alive through the output
    assert_runs_like_eager(program, case.build(), case.step_inputs, caller_state=case.make_state())


@torch.library.custom_op("wbtest::mix", mutates_args=())
def mix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A custom op taking both states: its schema is not trusted, so they may alias."""
    return a * 0.5 + b


@mix.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(a)


class StatesMayAlias(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(16))
        self.register_buffer("b", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new_a = x * 2
        new_b = x + 1
        mixed = torch.ops.wbtest.mix(self.a, self.b)
        self.a.copy_(new_a)
        self.b.copy_(new_b + self.a)
        return mixed


def test_write_backs_whose_states_may_alias_fall_back_in_original_order() -> None:
    ep = _aten_program(StatesMayAlias())
    result = insert_write_back_early(ep)
    assert result.fallback is not None
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    copies = [n.args[0].name for n in calls if n.target is torch.ops.aten.copy_.default]
    assert copies == ["b_a", "b_b"]
    assert [n.target for n in calls[-2:]] == [torch.ops.aten.copy_.default] * 2
    _run_graph(ep, StatesMayAlias())
