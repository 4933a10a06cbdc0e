"""Every refusal of ``reinplace_state_writes``: one test per reason the pass returns, each
asserting the reason string, as torch's reinplace tests check each rule.

Graphs are traced over aten ops with ``make_fx`` (real FakeTensor metadata); the first
placeholder is the state and the first output its new value. A few reasons guard graphs no
trace produces (a missing ``val``, a dtype the op would refuse): those graphs are traced
valid and then given the flaw, as a hand-written or third-party pass could leave them.
Every test first checks the rule is what refuses: where the flaw is an edit, the same graph
without it is accepted (``None``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from writeback_core.partition import DELEGATION_TAG
from writeback_passes.state_write_refusals import in_place_kernel_refusal

aten = torch.ops.aten
STATE = torch.zeros(4, 3)
ROW = torch.ones(1, 3)
POS = torch.tensor([1])


def _trace(fn: Callable[..., Any], *args: Any, mode: str = "fake") -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode=mode)(*args)


def _nodes(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _state_and_value(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, torch.fx.Node]:
    state = next(n for n in gm.graph.nodes if n.op == "placeholder")
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = out.args[0][0] if isinstance(out.args[0], (list, tuple)) else out.args[0]
    assert isinstance(value, torch.fx.Node)
    return state, value


def _refusal(gm: torch.fx.GraphModule) -> str | None:
    state, value = _state_and_value(gm)
    return in_place_kernel_refusal(gm.graph, state.name, value.name)


def _first(gm: torch.fx.GraphModule, packet: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target._opname == packet)


def _put(state: torch.Tensor, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return aten.index_put.default(state, [pos], row)


def _put_gm() -> torch.fx.GraphModule:
    gm = _trace(_put, STATE, POS, ROW)
    assert _refusal(gm) is None
    return gm


# index_put


def test_index_put_with_accumulate_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.index_put.default(s, [p], r, True), STATE, POS, ROW)
    assert _refusal(gm) == "index_put with accumulate=True has no in-place kernel (index_put_ refuses accumulate)"


def test_index_put_with_two_index_tensors_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.index_put.default(s, [p, p], r[0, :1]), STATE, POS, ROW)
    assert _refusal(gm) == "index_put with 2 index tensors; the in-place kernel takes exactly one"


def test_index_put_with_a_two_dimensional_index_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.index_put.default(s, [p.view(1, 1)], r.view(1, 1, 3)), STATE, POS, ROW)
    assert _refusal(gm) == (
        "index_put's index is 2-d torch.int64; the in-place kernel takes one 1-d int64/int32 index tensor"
    )


def test_index_put_into_state_of_no_known_shape_is_refused() -> None:
    gm = _put_gm()
    state, _ = _state_and_value(gm)
    del state.meta["val"]
    assert _refusal(gm) == "'state_1' has no known shape"


def test_index_put_into_a_dim_of_run_time_size_is_refused() -> None:
    """Eager wraps a negative index by the dim's size, which the graph does not know."""
    gm = _trace(_put, STATE, POS, ROW, mode="symbolic")
    assert _refusal(gm) == (
        "index_put into a dim whose size is known only at run time; a negative index could not be wrapped"
    )


def test_values_of_no_known_shape_are_refused() -> None:
    gm = _put_gm()
    del _nodes(gm)["row_1"].meta["val"]
    assert _refusal(gm) == "the values 'row_1' have no known shape"


def test_values_of_higher_rank_than_the_write_are_refused() -> None:
    """ATen's index_put drops leading size-1 dims of the values; the kernel does not."""
    gm = _trace(_put, STATE, POS, torch.ones(1, 1, 3))
    assert _refusal(gm) == "values of shape (1, 1, 3) do not fit the write's shape (1, 3)"


def test_values_that_need_a_reshape_to_a_run_time_shape_are_refused() -> None:
    """A row broadcast over a run-time number of positions: the expand's size is symbolic."""
    two = torch.tensor([1, 2])
    gm = _trace(lambda s, p, r: aten.index_put.default(s, [p], r[0]), STATE, two, ROW, mode="symbolic")
    state, index = [n for n in gm.graph.nodes if n.op == "placeholder"][:2]
    # The state's and the row's sizes are static (a buffer, a model's width), the index's length is not.
    state.meta["val"] = _static_like(gm, STATE)
    _first(gm, "select").meta["val"] = _static_like(gm, ROW[0])
    shape = tuple(index.meta["val"].shape)
    assert not isinstance(shape[0], int)
    assert _refusal(gm) == "values of shape (3,) need reshaping to a shape known only at run time"


def _static_like(gm: torch.fx.GraphModule, tensor: torch.Tensor) -> torch.Tensor:
    from torch._guards import detect_fake_mode

    fake = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    assert fake is not None
    return fake.from_tensor(tensor, static_shapes=True)


def test_values_that_do_not_broadcast_are_refused() -> None:
    gm = _put_gm()
    row = _nodes(gm)["row_1"]
    row.meta["val"] = torch.empty(2, 3, device="meta")
    assert _refusal(gm) == "values of shape (2, 3) do not broadcast to the write's shape (1, 3)"


def test_values_that_are_not_a_graph_tensor_are_refused() -> None:
    gm = _put_gm()
    put = _first(gm, "index_put")
    put.args = (put.args[0], put.args[1], 1.0)
    assert _refusal(gm) == "the values written are not a tensor of the graph"


def test_values_of_another_dtype_are_refused() -> None:
    gm = _put_gm()
    _nodes(gm)["row_1"].meta["val"] = torch.empty(1, 3, dtype=torch.float64, device="meta")
    assert _refusal(gm) == "values of dtype torch.float64 written into torch.float32 state"


# index_copy


def test_index_copy_with_a_zero_dimensional_index_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.index_copy.default(s, 0, p[0], r), STATE, POS, ROW)
    assert _refusal(gm) == "index_copy's index is not one 1-d int64/int32 tensor"


def test_index_copy_into_state_of_unknown_rank_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.index_copy.default(s, 0, p, r), STATE, POS, ROW)
    assert _refusal(gm) is None
    state, _ = _state_and_value(gm)
    del state.meta["val"]
    assert _refusal(gm) == "index_copy into 's_1', whose rank is unknown"


def test_index_copy_along_a_dim_the_state_lacks_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.index_copy.default(s, -2, p, r), STATE, POS, ROW)
    assert _refusal(gm) is None  # -2 is dim 0 of a 2-d state
    copy = _first(gm, "index_copy")
    copy.args = (copy.args[0], 2, *copy.args[2:])
    assert _refusal(gm) == (
        "index_copy into 's_1': dimension out of range (expected to be in range of [-2, 1] for a "
        "tensor of rank 2, but got 2)"
    )


# slice_scatter


def _slice(state: torch.Tensor, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return aten.slice_scatter.default(state, row.expand(2, 3), 0, 1, 3)


def test_slice_scatter_with_no_known_shapes_is_refused() -> None:
    gm = _trace(_slice, STATE, POS, ROW)
    assert _refusal(gm) is None
    del _first(gm, "expand").meta["val"]
    assert _refusal(gm) == "slice_scatter with no known shapes"


@pytest.mark.parametrize("step", [0, -1])
def test_slice_scatter_with_a_step_below_one_is_refused(step: int) -> None:
    gm = _trace(_slice, STATE, POS, ROW)
    scatter = _first(gm, "slice_scatter")
    scatter.args = (*scatter.args[:5], step)
    assert _refusal(gm) == f"slice_scatter with step {step}; only a positive constant step is written in place"


def test_slice_scatter_with_run_time_bounds_that_may_pass_the_end_is_refused() -> None:
    """``state[:n] = rows`` with ``n`` the rows' length and the state's size both known only at
    run time: eager clamps ``n`` to the size, ``arange(0, n)`` would not."""

    def fn(state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return aten.slice_scatter.default(state, rows, 0, 0, rows.shape[0])

    gm = _trace(fn, STATE, torch.ones(2, 3), mode="symbolic")
    reason = _refusal(gm)
    assert reason is not None
    assert re.fullmatch(
        r"slice_scatter into 'state_1' with bounds \(0, sym_size_int(_\d+)?\) known only at run time that may "
        r"fall outside \[0, s\d+\]: eager wraps and clamps them, the in-place kernel would fail the call",
        reason,
    ), reason


# select_scatter


def _select(state: torch.Tensor, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return aten.select_scatter.default(state, row[0], 0, -2)


def _select_gm() -> torch.fx.GraphModule:
    gm = _trace(_select, STATE, POS, ROW)
    assert _refusal(gm) is None
    return gm


def test_select_scatter_at_a_run_time_position_is_refused() -> None:
    gm = _select_gm()
    scatter = _first(gm, "select_scatter")
    scatter.args = (*scatter.args[:3], _nodes(gm)["pos_1"])
    assert _refusal(gm) == "select_scatter at a position known only at run time"


def test_select_scatter_along_a_dim_of_run_time_size_is_refused() -> None:
    gm = _trace(_select, STATE, POS, ROW, mode="symbolic")
    assert _refusal(gm) == "select_scatter along dim 0 of 'state_1', whose size is known only at run time"


def test_select_scatter_at_a_position_past_the_end_is_refused() -> None:
    gm = _select_gm()
    scatter = _first(gm, "select_scatter")
    scatter.args = (*scatter.args[:3], 4)
    assert _refusal(gm) == (
        "select_scatter into 'state_1' along dim 0: index 4 is out of bounds for a dimension of size 4"
    )


def test_select_scatter_into_state_of_a_run_time_shape_is_refused() -> None:
    """Dim 0 has size 1 (a static size even in a symbolic trace); dim 1 is symbolic."""
    gm = _trace(_select, torch.zeros(1, 3), POS, ROW, mode="symbolic")
    scatter = _first(gm, "select_scatter")
    scatter.args = (*scatter.args[:3], 0)
    assert _refusal(gm) == "select_scatter into state of a shape known only at run time"


def test_select_scatter_values_not_shaped_like_the_slice_are_refused() -> None:
    gm = _select_gm()
    _first(gm, "select").meta["val"] = torch.empty(4, device="meta")
    assert _refusal(gm) == "select_scatter's values do not have the selected slice's shape"


# where (select_scatter as torch.export decomposes it)


def _where_select(state: torch.Tensor, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    positions = aten.view_copy.default(aten.arange.default(4), [4, 1])
    mask = aten.eq.Scalar(positions, 2)
    values = aten.expand_copy.default(aten.unsqueeze_copy.default(row[0], 0), [4, 3])
    return aten.where.self(mask, values, state)


def test_where_that_is_no_selected_write_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.where.self(aten.gt.Scalar(s, 0.0), r.expand(4, 3), s), STATE, POS, ROW)
    assert _refusal(gm) == "the new value comes from where, not an indexed write"


def test_where_with_its_mask_inside_a_delegate_is_refused() -> None:
    gm = _trace(_where_select, STATE, POS, ROW)
    assert _refusal(gm) is None
    _first(gm, "eq").meta[DELEGATION_TAG] = "tag0"
    assert _refusal(gm) == "select_scatter's mask or values are computed inside a delegate"


# the chain from the state to its new value


def test_value_that_is_not_computed_from_the_state_is_refused() -> None:
    gm = _put_gm()
    assert in_place_kernel_refusal(gm.graph, "state_1", "row_1") == (
        "the new value of 'state_1' is not written into it by an indexed write"
    )


def test_value_that_is_no_indexed_write_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.add.Tensor(s, 1.0), STATE, POS, ROW)
    assert _refusal(gm) == (
        "the new value comes from add, not an indexed write; the stock runtime's only in-place state "
        "kernel is aten::index_put_"
    )


def test_indexed_write_into_a_computed_tensor_is_refused() -> None:
    gm = _trace(lambda s, p, r: aten.index_put.default(aten.mul.Tensor(s, 2.0), [p], r), STATE, POS, ROW)
    assert _refusal(gm) == "'mul' (mul) writes before the indexed writes"


def test_more_than_sixty_four_chained_writes_are_refused() -> None:
    def chain(count: int) -> Callable[..., torch.Tensor]:
        def fn(state: torch.Tensor, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
            for _ in range(count):
                state = aten.index_put.default(state, [pos], row)
            return state

        return fn

    assert _refusal(_trace(chain(64), STATE, POS, ROW)) is None
    assert _refusal(_trace(chain(65), STATE, POS, ROW)) == "more than 64 chained writes"


def test_values_read_from_the_state_itself_are_refused() -> None:
    """``state[1] = state[0]``: the values alias the state the write overwrites."""
    gm = _trace(lambda s, p, r: aten.index_put.default(s, [p], aten.slice.Tensor(s, 0, 0, 1)), STATE, POS, ROW)
    assert _refusal(gm) == (
        "'index_put' writes 's_1' from slice_1, which may share its storage: an in-place write would "
        "overlap what it reads"
    )


def test_old_value_read_after_the_write_is_refused() -> None:
    def fn(state: torch.Tensor, pos: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = aten.index_put.default(state, [pos], row)
        return new, aten.sum.default(state)

    gm = _trace(fn, STATE, POS, ROW)
    assert _refusal(gm) == (
        "'sum_1' reads the old value of 'state_1' (through 'state_1') after 'index_put' writes it; "
        "writing in place would change what it reads"
    )


def test_state_a_delegate_takes_as_constant_data_is_refused() -> None:
    gm = _put_gm()
    state, _ = _state_and_value(gm)
    state.meta[DELEGATION_TAG] = "tag0"
    assert _refusal(gm) == "'state_1' is consumed into a delegate as constant data"


def test_names_the_graph_lacks_are_refused() -> None:
    gm = _put_gm()
    assert in_place_kernel_refusal(gm.graph, "state_1", "nowhere") == ("the graph has no node 'state_1' or 'nowhere'")
