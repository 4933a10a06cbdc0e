"""XNNPACK's preprocess with the passes that find nothing skipped
(:mod:`writeback_passes.xnnpack_preprocess`): the ``.pte`` is XNNPACK's own, byte for byte, and
runs as eager PyTorch does, for a decoder-like block (most passes skipped) and for a block with a
convolution and a batch norm (their passes kept)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.lowered_backend_module import get_lowered_submodules
from executorch.runtime import Runtime
from torch import nn
from torch.nn import functional
from writeback_passes.xnnpack_preprocess import _finds_nothing, xnnpack_passes_pruned


class _Attention(nn.Module):
    """Linear layers, attention, a concatenation and an activation: what a decoder layer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, 4, 3, 2, 16).unbind(2)
        attended = functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        joined = torch.cat([attended.transpose(1, 2).reshape(1, 4, 32), x], dim=-1)
        return functional.silu(self.out(joined))


class _ConvNorm(nn.Module):
    """A 1-d convolution, a batch norm and a ReLU: what the skipped passes are for."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3)
        self.norm = nn.BatchNorm1d(8)
        self.norm.running_mean = torch.linspace(-1, 1, 8)
        self.norm.running_var = torch.linspace(0.5, 2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.relu(self.norm(self.conv(x)))


def _pte(module: nn.Module, example: torch.Tensor, pruned: bool) -> bytes:
    program = torch.export.export(module.eval(), (example,))
    with xnnpack_passes_pruned() if pruned else nullcontext():
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    data: bytes = edge.to_executorch().buffer
    return data


@pytest.mark.parametrize(
    ("make", "shape"), [(_Attention, (1, 4, 32)), (_ConvNorm, (1, 4, 10))], ids=["attention", "conv-norm"]
)
def test_skipping_the_passes_that_find_nothing_keeps_xnnpack_s_pte_byte_for_byte(
    make: type[nn.Module], shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    module = make().eval()
    example = torch.randn(shape)
    pruned = _pte(module, example, pruned=True)
    assert pruned == _pte(module, example, pruned=False)
    method = Runtime.get().load_program(pruned).load_method("forward")
    (output,) = method.execute([example])
    with torch.no_grad():
        expected = module(example)
    torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-4)


def _partition_graphs(module: nn.Module, example: torch.Tensor) -> list[torch.fx.Graph]:
    """The graph of each partition XNNPACK takes, as its ``preprocess`` receives it."""
    edge = to_edge_transform_and_lower(
        torch.export.export(module.eval(), (example,)), partitioner=[XnnpackPartitioner()]
    )
    lowered = [m for _, m, _ in get_lowered_submodules(edge.exported_program().graph_module)]
    return [m.original_module.graph_module.graph for m in lowered]


def test_a_pass_is_skipped_only_when_the_graph_lacks_what_it_rewrites() -> None:
    (with_conv,) = _partition_graphs(_ConvNorm(), torch.randn(1, 4, 10))
    attention = _partition_graphs(_Attention(), torch.randn(1, 4, 32))
    needs: dict[str, list[frozenset[str]]] = {}
    for without in attention:
        for name in ("Conv1dUnsqueezePass", "DecomposeBatchNorm", "FuseBatchNormPass", "FuseActivationPass"):
            assert _finds_nothing(name, without, needs), name
            assert not _finds_nothing(name, with_conv, needs), name
        assert _finds_nothing("ConvertToUpsampleBilinear2d", without, needs)
        # A pass not in the table always runs.
        assert not _finds_nothing("ChannelsLastTaggedReshapePass", without, needs)


def test_the_op_a_pattern_pass_is_keyed_on_is_in_every_pattern_xnnpack_matches() -> None:
    from writeback_passes.xnnpack_preprocess import _EVERY_PATTERN_HOLDS, _NEEDS

    for name, op in _EVERY_PATTERN_HOLDS.items():
        patterns = _NEEDS[name]()
        assert patterns, name
        for ops in patterns:
            assert op in ops, f"{name}: a pattern without {op}: {sorted(ops)}"


def test_a_graph_without_the_key_op_skips_a_pattern_pass_without_building_its_patterns() -> None:
    (graph,) = _partition_graphs(_ConvNorm(), torch.randn(1, 4, 10))
    needs: dict[str, list[frozenset[str]]] = {}
    assert _finds_nothing("ConvertToSDPAPass", graph, needs)
    assert "ConvertToSDPAPass" not in needs


def _dequantized_input(custom_on_dequantize: object) -> torch.fx.Graph:
    """x -> dequantize_per_tensor(x) -> output, x carrying ``custom`` metadata."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["custom"] = {"delegate_constant_tag": "weights"}
    dq = graph.call_function(
        torch.ops.quantized_decomposed.dequantize_per_tensor.default, (x, 0.1, 0, -128, 127, torch.int8)
    )
    if custom_on_dequantize is not None:
        dq.meta["custom"] = x.meta["custom"] if custom_on_dequantize == "same" else custom_on_dequantize
    graph.output(dq)
    return graph


def test_custom_metadata_propagation_is_skipped_only_when_every_dequantize_carries_its_input_s() -> None:
    needs: dict[str, list[frozenset[str]]] = {}
    assert not _finds_nothing("PropagateCustomMetaPass", _dequantized_input(None), needs)
    assert not _finds_nothing("PropagateCustomMetaPass", _dequantized_input({"other": 1}), needs)
    assert _finds_nothing("PropagateCustomMetaPass", _dequantized_input("same"), needs)
    (plain,) = _partition_graphs(_ConvNorm(), torch.randn(1, 4, 10))
    assert _finds_nothing("PropagateCustomMetaPass", plain, needs)


def test_passes_keyed_on_ops_xnnpack_lists_are_skipped_only_without_those_ops() -> None:
    needs: dict[str, list[frozenset[str]]] = {}
    (with_conv,) = _partition_graphs(_ConvNorm(), torch.randn(1, 4, 10))
    for name in ("DimOrderOpsRevertPass", "ConvertToLinearPass", "RemoveRedundantCopyPass"):
        assert _finds_nothing(name, with_conv, needs), name
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    from executorch.exir.dialects._ops import ops as exir_ops

    graph.output(graph.call_function(exir_ops.edge.aten.mm.default, (a, b)))
    assert not _finds_nothing("ConvertToLinearPass", graph, needs)
    assert _finds_nothing("DimOrderOpsRevertPass", graph, needs)
