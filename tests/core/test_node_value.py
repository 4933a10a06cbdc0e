"""Core's one reader of a graph node's traced value (``writeback_core.ops.node_value``)."""

from __future__ import annotations

import torch
import torch.fx
from writeback_core.ops import node_value


class _AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_a_node_gives_the_value_traced_for_it_a_literal_or_bare_node_none() -> None:
    program = torch.export.export(_AddOne(), (torch.ones(2, 3),))
    add = next(n for n in program.graph.nodes if n.op == "call_function")
    x, one = add.args
    # The input's shape and dtype as given to export; the sum keeps them.
    assert tuple(node_value(x).shape) == (2, 3) and node_value(x).dtype == torch.float32
    assert tuple(node_value(add).shape) == (2, 3)
    assert one == 1 and node_value(one) is None
    assert node_value(torch.fx.Graph().placeholder("bare")) is None
