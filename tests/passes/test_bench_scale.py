"""The scale benchmark's synthetic graph: the pass must be correct on it, not only fast."""

from __future__ import annotations

import copy

import torch
from writeback_bench.passes_scale import count_calls, synthetic_graph
from writeback_passes import insert_write_back_early


def _run(gm: torch.fx.GraphModule, states: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    out = gm(*states, x)
    return out[-1]


def test_synthetic_graph_moves_every_copy_next_to_its_value_and_computes_like_stock() -> None:
    stock, names = synthetic_graph(400)
    early = copy.deepcopy(stock)
    result = insert_write_back_early(early)
    assert {p.state for p in result.placements} == names
    for placed in result.placements:
        assert placed.after == placed.value
    # Every copy but the last state's (whose value ends the chain) moved up.
    assert all(p.early_position < p.stock_position for p in result.placements[:-1])
    # Same values and same final states as exir's end-of-graph placement.
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(3, generator=gen) for _ in names]
    x = torch.randn(3, generator=gen)
    stock_states = [t.clone() for t in initial]
    early_states = [t.clone() for t in initial]
    torch.testing.assert_close(_run(early, early_states, x), _run(stock, stock_states, x))
    for got, want, first in zip(early_states, stock_states, initial, strict=True):
        torch.testing.assert_close(got, want)
        assert not torch.equal(got, first)


def test_pass_work_grows_linearly_with_graph_size() -> None:
    """Counted function calls, not time: ten times the nodes, about ten times the work."""
    ratio = count_calls(2_000) / count_calls(200)
    assert 8 <= ratio <= 12, ratio
