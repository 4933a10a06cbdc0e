"""Every zoo model, lowered with the early pass, runs like eager; plain write-backs land right after their value."""

from __future__ import annotations

import pytest
import torch
import writeback_passes
from writeback.zoo import builtin_models
from writeback_core import MutationKind, find_mutations
from writeback_passes import insert_write_back_early

from .hazard_models import Plain, seeded
from .lowering import assert_runs_like_eager, edge_of, lower

ZOO = sorted(builtin_models())

_CASES = [
    pytest.param(name, reinplace, id=f"{name}-{'run_reinplace_pass' if reinplace else 'stock-config'}")
    for name in ZOO
    for reinplace in (False, True)
]


@pytest.mark.parametrize(("name", "reinplace"), _CASES)
def test_zoo_model_runs_like_eager_over_four_calls(name: str, reinplace: bool) -> None:
    """Outputs, buffers (read from the runtime) and returned caller state match eager.

    For ``decoder-caller-cache`` the stock runtime does not write the caller's
    tensors; the updated caches come back as outputs and are compared with
    eager's in-place updated caches, then fed to the next call.
    """
    case = builtin_models()[name]
    program = lower(case.build(), case.example_args(0), run_reinplace_pass=reinplace)
    assert_runs_like_eager(program, case.build(), case.step_inputs, calls=4, caller_state=case.make_state())


@pytest.mark.parametrize("name", ZOO)
def test_zoo_write_backs_land_right_after_their_value(name: str) -> None:
    """In every zoo model nothing reads a state's old contents after its new value is
    ready, so each copy (into a buffer or a caller's cache) is the very next call
    after its value, and the output returns the caller's state placeholder."""
    case = builtin_models()[name]
    program = lower(case.build(), case.example_args(0))
    report = writeback_passes.memory_plan_report(program)
    (plan,) = report.methods.values()
    ep = program.exported_program()
    kinds = {m.target: m.kind for m in find_mutations(ep)}
    assert {wb.target for wb in plan.write_backs} == set(kinds)
    for wb in plan.write_backs:
        assert wb.copy_index == wb.value_index + 1, wb
    returned = {n.name for n in ep.graph.output_node().all_input_nodes}
    users = {wb.state for wb in plan.write_backs if kinds[wb.target] is MutationKind.USER_INPUT}
    assert users <= returned
    assert bool(users) == (name == "decoder-caller-cache")


def test_plain_copy_lands_immediately_after_its_value_in_the_pass() -> None:
    """On the edge program (the pass adding exir's copies itself), the copy follows its value."""
    ep = edge_of(Plain(), (seeded(1, 16),)).exported_program()
    result = insert_write_back_early(ep)
    (placed,) = result.placements
    nodes = list(ep.graph.nodes)
    names = [n.name for n in nodes]
    copy = nodes[names.index(placed.copy)]
    assert copy.target is torch.ops.aten.copy_.default
    assert copy.prev.name == placed.value == copy.args[1].name
    assert copy.args[0].name == placed.state == "b_state"
    # The stock pass put it last, before the output: three tail nodes later.
    assert placed.stock_position == len(nodes) - 2
    assert placed.early_position == names.index(placed.value) + 1
    assert result.modified and result.analysed and result.fallback is None


def test_pass_is_idempotent_on_its_own_output() -> None:
    ep = edge_of(Plain(), (seeded(1, 16),)).exported_program()
    insert_write_back_early(ep)
    first = [n.name for n in ep.graph.nodes]
    again = insert_write_back_early(ep)
    assert [n.name for n in ep.graph.nodes] == first
    assert not again.modified


def test_bad_program_type_is_refused_with_the_type_named() -> None:
    with pytest.raises(TypeError, match=r"ExportedProgram or a torch\.fx\.GraphModule, got str"):
        insert_write_back_early("forward")  # type: ignore[arg-type]


def test_stock_exir_clobbers_caller_cache_written_by_reinplaced_op() -> None:
    """Why step 5 of the pass exists: with ``run_reinplace_pass`` the caller's cache is written by
    an in-place ``index_put_`` the graph returns; exir 1.5.1's planner skips in-place nodes in
    lifetimes and reuses the input's slot, so stock returns a clobbered cache (the early
    pipeline passes the same case in ``test_zoo_model_runs_like_eager_over_four_calls``)."""
    case = builtin_models()["decoder-caller-cache"]
    program = lower(case.build(), case.example_args(0), early=False, run_reinplace_pass=True)
    with pytest.raises(AssertionError, match="call 0 state 0"):
        assert_runs_like_eager(program, case.build(), case.step_inputs, calls=1, caller_state=case.make_state())


def test_exported_program_mode_on_caller_cache_runs_like_eager_in_python() -> None:
    """The pass on an edge ``ExportedProgram`` (copies added by exir's pass, then moved, outputs
    and signature renamed to the caller's placeholders), run as a Python graph against eager."""
    from torch.export.graph_signature import InputKind, OutputKind

    case = builtin_models()["decoder-caller-cache"]
    ep = edge_of(case.build(), case.example_args(0)).exported_program()
    result = insert_write_back_early(ep)
    assert {p.state for p in result.placements} == {"caches_0", "caches_1"}
    returned = [n.name for n in ep.graph.output_node().all_input_nodes]
    mutated = [s.arg.name for s in ep.graph_signature.output_specs if s.kind is OutputKind.USER_INPUT_MUTATION]
    assert mutated == ["caches_0", "caches_1"] == returned[:2]
    eager = case.build()
    eager_state = list(case.make_state())
    caller_state = [t.clone() for t in eager_state]
    lifted = {**ep.constants, **ep.state_dict}  # parameters, and constants lifted as buffers
    for call in range(4):
        step = case.step_inputs(call)
        user = iter([*step, *caller_state])
        args = [
            next(user) if s.kind is InputKind.USER_INPUT else lifted[s.target] for s in ep.graph_signature.input_specs
        ]
        with torch.no_grad():
            expected = eager(*step, *eager_state)
            outputs = ep.graph_module(*args)
        torch.testing.assert_close(outputs[-1], expected, msg=f"call {call}")
        for got, want in zip(caller_state, eager_state, strict=True):
            torch.testing.assert_close(got, want, msg=f"call {call} caller state")
