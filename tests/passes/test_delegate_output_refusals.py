"""Each refusal rule of ``delegate_output_refusal`` made to fire on a real XNNPACK lowering.

A buffer rewritten whole inside one XNNPACK partition (``h.copy_(h * 0.5 + x)``) is lowered
through the real pipeline up to the point where ``whole_state_writes`` asks
``delegate_output_refusal`` whether the delegate's result may be planned onto the state: a
pass ordered before it stops the lowering there and hands the graph over. The untouched graph
is accepted (worked out by hand: the delegate reads ``h`` once, elementwise, in the operator
that writes its new value). Each test then changes that graph minimally the way its case
would look and checks that the refusal names the cause.
"""

from __future__ import annotations

import torch
import torch.fx
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.dialects._ops import ops as exir_ops
from torch import nn
from writeback_core import ProgramPass, Stage, hookimpl, meta
from writeback_core.ops import write_back_copies
from writeback_core.partition import to_edge_arguments
from writeback_core.registry import load_registry
from writeback_passes.delegate_state_outputs import delegate_output_refusal, delegate_writer, is_delegate_output

from .lowering import export_module


class HalfLife(nn.Module):
    """An SSM-like state halved and fed each call: ``h = h * 0.5 + x``."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.arange(32.0).reshape(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h.copy_(self.h * 0.5 + x)
        return x + 1.0


class _Reached(Exception):
    """Raised by :class:`_StopBeforeWholeStateWrites` with the graph it was handed."""

    def __init__(self, graph_module: torch.fx.GraphModule) -> None:
        super().__init__("the lowering reached whole_state_writes")
        self.graph_module = graph_module


class _StopBeforeWholeStateWrites:
    """A plugin whose one pass runs just before ``whole_state_writes`` and stops the lowering."""

    writeback_name = "stop_before_whole_state_writes"

    @hookimpl
    def writeback_program_passes(self, stage: Stage) -> tuple[ProgramPass, ...]:
        if stage != "after_out_variants":
            return ()
        return (
            ProgramPass(
                name="stop_before_whole_state_writes",
                stage="after_out_variants",
                run=self._stop,
                backends=frozenset({"xnnpack"}),
                before=("whole_state_writes",),
                reason="hands the test the graph whole_state_writes would see",
            ),
        )

    @staticmethod
    def _stop(graph_module: torch.fx.GraphModule) -> None:
        raise _Reached(graph_module)


def _reached(error: BaseException | None) -> _Reached:
    while error is not None and not isinstance(error, _Reached):
        error = error.__cause__ or error.__context__
    assert isinstance(error, _Reached), "the lowering never reached whole_state_writes"
    return error


def _write_back() -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """``(state, new, copy)`` of ``HalfLife``'s write-back, as ``whole_state_writes`` sees it
    on XNNPACK (a fresh lowering each time: every test alters its own graph)."""
    import writeback_passes

    registry = load_registry(plugins=[_StopBeforeWholeStateWrites()])
    program = export_module(HalfLife(), (torch.ones(4, 8),))
    edge = to_edge_transform_and_lower(program, **to_edge_arguments("xnnpack", registry=registry))
    try:
        writeback_passes.to_executorch(edge, registry=registry)
    except Exception as error:  # the stop, or an error of exir's wrapping it
        graph = _reached(error).graph_module.graph
    else:
        raise AssertionError("the lowering never reached whole_state_writes")
    (copy,) = write_back_copies(graph)
    state, new = copy.args[0], copy.args[1]
    assert isinstance(state, torch.fx.Node) and isinstance(new, torch.fx.Node)
    assert is_delegate_output(new), f"{new} is not a result of the XNNPACK delegate"
    return state, new, copy


def _call(new: torch.fx.Node) -> torch.fx.Node:
    call = new.args[0]
    assert isinstance(call, torch.fx.Node)
    return call


def _writer_in_delegate() -> tuple[
    torch.fx.Node, torch.fx.Node, torch.fx.Node, torch.export.ExportedProgram, torch.fx.Node, int
]:
    """``_write_back()``'s nodes, then the delegated graph and the operator in it that writes the
    state's new value (the delegate's result ``index``), for a test to change by hand."""
    state, new, copy = _write_back()
    index = new.args[1]
    assert isinstance(index, int)
    found = delegate_writer(_call(new), index)
    assert found is not None
    program, add = found
    return state, new, copy, program, add, index


def _refusal(state: torch.fx.Node, new: torch.fx.Node, copy: torch.fx.Node) -> str:
    why = delegate_output_refusal(state, new, copy)
    assert why is not None, "the altered graph was accepted"
    return why


def test_the_untouched_elementwise_state_update_is_accepted() -> None:
    assert delegate_output_refusal(*_write_back()) is None


def test_a_state_that_is_the_callers_input_is_refused() -> None:
    state, new, copy = _write_back()
    meta.set_custom(state, meta.USER_INPUT, True)
    assert "the state is the caller's input" in _refusal(state, new, copy)


def test_a_result_of_another_dtype_is_refused() -> None:
    state, new, copy = _write_back()
    new.meta["val"] = torch.empty(4, 8, dtype=torch.float64, device="meta")
    assert "differs from the state in shape, dtype or layout" in _refusal(state, new, copy)


def test_a_result_of_another_layout_is_refused() -> None:
    state, new, copy = _write_back()
    new.meta["val"] = torch.empty_strided((4, 8), (1, 4), device="meta")  # column-major
    assert "differs from the state in shape, dtype or layout" in _refusal(state, new, copy)


def test_a_result_of_another_shape_is_refused() -> None:
    state, new, copy = _write_back()
    new.meta["val"] = torch.empty(8, 4, device="meta")
    assert "differs from the state in shape, dtype or layout" in _refusal(state, new, copy)


def test_a_state_passed_to_the_delegate_twice_is_refused() -> None:
    state, new, copy = _write_back()
    call = _call(new)
    call.args = (*call.args, state)
    assert "the state is passed to the delegate 2 times" in _refusal(state, new, copy)


def test_a_view_of_the_state_passed_beside_it_is_refused() -> None:
    state, new, copy = _write_back()
    call = _call(new)
    with call.graph.inserting_before(call):
        view = call.graph.call_function(torch.ops.aten.alias.default, (state,))
    call.args = (*call.args, view)
    why = _refusal(state, new, copy)
    assert "a view of the state" in why and "is passed to the delegate beside it" in why, why


def test_delegate_arguments_not_matching_its_graphs_user_inputs_are_refused() -> None:
    state, new, copy = _write_back()
    call = _call(new)
    extra = next(n for n in call.graph.nodes if n.op == "placeholder" and n is not state)
    call.args = (*call.args, extra)
    why = _refusal(state, new, copy)
    assert "which of them is the state cannot be told" in why, why
    # HalfLife's delegated graph takes h, x and the constants 0.5 and 1.0 (lifted to tensors);
    # the call now passes one more.
    assert "has 4 user inputs where the call passes 5" in why, why


def test_an_operator_fused_into_the_writer_reading_the_state_is_refused() -> None:
    """``clamp(h * 0.5 + x, min=h)``: XNNPACK fuses the clamp into the add that writes the new
    state, so the clamp would read ``h`` while the add overwrites it."""
    state, new, copy, program, add, index = _writer_in_delegate()
    h = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == "b_h")
    with program.graph.inserting_after(add):
        clamp = program.graph.call_function(exir_ops.edge.aten.clamp.Tensor, (add, h))
    clamp.meta["val"] = add.meta["val"]
    output = program.graph.output_node()
    results = output.args[0]
    assert isinstance(results, (list, tuple)) and results[index] is add
    output.args = ([clamp if r is add else r for r in results],)
    why = _refusal(state, new, copy)
    assert "the operator writing it" in why and "reads the state through a view or copy of it" in why, why


def test_a_delegate_result_that_is_one_of_its_inputs_is_refused() -> None:
    """A delegated graph that returns its input ``x`` unchanged as the state's new value: no
    operator of it writes that result, so there is nothing to check and the copy stays."""
    state, new, copy, program, add, index = _writer_in_delegate()
    x = next(n for n in program.graph.nodes if n.op == "placeholder" and n is not add and n.name != "b_h")
    output = program.graph.output_node()
    results = output.args[0]
    assert isinstance(results, (list, tuple)) and results[index] is add
    output.args = ([x if r is add else r for r in results],)
    why = _refusal(state, new, copy)
    assert "passes the value through unchanged or holds no graph to check" in why, why
