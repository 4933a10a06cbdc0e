"""``writeback_passes.partition_merging``: exir's ``GroupBasedPartitioner`` answers every merge
check as it does without the change (pair by pair, cycles refused), and XNNPACK's ``.pte`` is
the same byte for byte."""

from __future__ import annotations

import collections
import itertools
from contextlib import nullcontext

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner
from torch import nn
from torch.fx.passes.operator_support import OperatorSupportBase
from writeback_passes.partition_merging import _merges_without_cycle, merge_checked_by_sets


class _AllButSigmoid(OperatorSupportBase):  # type: ignore[misc]  # torch's base is untyped here
    """Every operator but ``sigmoid``: a node the partitions must route around."""

    def is_node_supported(self, submodules: object, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and node.target is not torch.ops.aten.sigmoid.default


def _branches(x: torch.Tensor) -> torch.Tensor:
    """``a`` reaches ``d`` directly and through the unsupported ``sigmoid``: merging the
    partitions of ``a`` and ``d`` would make a cycle through it."""
    a = x * 2
    b = torch.sigmoid(a)
    c = b + 1
    d = a - c
    e = torch.relu(x)
    return d * e


def test_every_merge_check_answers_as_the_partitioner_s_own() -> None:
    program = torch.export.export(_Wrap(), (torch.randn(4),))
    partitioner = GroupBasedPartitioner(program.graph_module, _AllButSigmoid())
    partitions: dict[int, object] = {}
    reachable: collections.defaultdict[int, set[int]] = collections.defaultdict(set)
    partitioner._process_all_nodes(itertools.count(), partitions, {}, {}, {}, {}, reachable)
    answers = []
    for first, second in itertools.combinations(sorted(partitions), 2):
        expected = GroupBasedPartitioner._can_merge_partitions(partitioner, first, second, partitions)
        assert _merges_without_cycle(partitioner, first, second, partitions) == expected, (first, second)
        answers.append(expected)
    assert True in answers and False in answers


class _Wrap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _branches(x)


class _Block(nn.Module):
    """Linear layers around an unsupported op, with a path around it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.first(x)
        return self.second(torch.sigmoid(a) + a) + torch.nn.functional.gelu(a)


def test_xnnpack_s_pte_is_the_same_byte_for_byte() -> None:
    torch.manual_seed(0)
    program = torch.export.export(_Block().eval(), (torch.randn(2, 8),))

    def pte(checked: bool) -> bytes:
        with merge_checked_by_sets() if checked else nullcontext():
            edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        data: bytes = edge.to_executorch().buffer
        return data

    assert pte(True) == pte(False)
