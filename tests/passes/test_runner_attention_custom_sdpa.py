"""``llama::custom_sdpa`` reading a ``[1, heads, positions, dim]`` cache through a transpose (how
optimum-executorch's ``--use_custom_sdpa`` attention reads transformers' ``StaticCache``) gets the
cache itself, stored ``[1, positions, heads, dim]`` (``writeback_passes.runner_attention``).

A layer written as optimum writes it (cache written by ``index_copy_`` at the caller's
``cache_position``, read through ``transpose(1, 2)`` and a same-dtype ``.to``) answers as its
eager self over a prompt and a decode step once rewritten; each refusal rule fires on a variant
and leaves the graph unchanged. The optimum-cli recipe test runs the whole path in ExecuTorch's
``TextLLMRunner`` (tests/integrations/test_optimum_recipe.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from writeback_core.exporting import export_model
from writeback_core.llm_runner import load_runner_kernels
from writeback_passes.runner_attention import attention_to_runner_kernels

POSITIONS, HEADS, KV_HEADS, DIM = 16, 4, 2, 8

if not load_runner_kernels():  # pragma: no cover - the executorch wheel ships them
    pytest.skip("this executorch wheel ships no llama::custom_sdpa", allow_module_level=True)


class Layer(torch.nn.Module):
    """Grouped-query attention over a program-owned cache, read as optimum reads it; each
    variant breaks one rule."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor

    def __init__(self, variant: str = "") -> None:
        super().__init__()
        self.variant = variant
        torch.manual_seed(0)
        self.q = torch.nn.Linear(DIM, HEADS * DIM)
        self.kv = torch.nn.Linear(DIM, 2 * KV_HEADS * DIM)
        self.register_buffer("key_cache", torch.zeros(1, KV_HEADS, POSITIONS, DIM), persistent=False)
        self.register_buffer("value_cache", torch.zeros(1, KV_HEADS, POSITIONS, DIM))

    def forward(self, x: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        start = cache_position[0].item()
        torch._check(start >= 0)
        torch._check(start + n <= POSITIONS)
        q = self.q(x).view(1, n, HEADS, DIM).transpose(1, 2)
        k, v = self.kv(x).view(1, n, 2, KV_HEADS, DIM).permute(2, 0, 3, 1, 4)
        keys = self.key_cache.index_copy_(2, cache_position, k)
        values = self.value_cache.index_copy_(2, cache_position, v)
        if self.variant == "slice-assigned":  # the cache written as key_cache[:, :, rows] = k
            self.key_cache[:, :, cache_position] = k
            keys = self.key_cache
        keys_read = keys.transpose(1, 2)
        dtype = torch.float64 if self.variant == "converted" else torch.float32
        out = torch.ops.llama.custom_sdpa(
            q.transpose(1, 2).to(torch.float32),
            keys_read.to(dtype).to(torch.float32),
            values.transpose(1, 2).to(torch.float32),
            start,
            None,
            0.0,
            True,
            None,
        )
        if self.variant == "cache-read-twice":
            out = out + keys.transpose(1, 2).mean()
        result: torch.Tensor = out.reshape(1, n, HEADS * DIM)
        return result


class CallerCache(Layer):
    """The same attention over a key cache the caller passes."""

    def forward(self, x: torch.Tensor, cache_position: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # a third input: the caller's key cache
        n = x.shape[1]
        start = cache_position[0].item()
        torch._check(start >= 0)
        torch._check(start + n <= POSITIONS)
        q = self.q(x).view(1, n, HEADS, DIM)
        k, v = self.kv(x).view(1, n, 2, KV_HEADS, DIM).permute(2, 0, 3, 1, 4)
        keys = cache.index_copy_(2, cache_position, k).transpose(1, 2)
        values = self.value_cache.index_copy_(2, cache_position, v).transpose(1, 2)
        out = torch.ops.llama.custom_sdpa(q, keys, values, start, None, 0.0, True, None)
        result: torch.Tensor = out.reshape(1, n, HEADS * DIM)
        return result


def _export(module: torch.nn.Module, caller_cache: bool = False) -> Any:
    tokens = torch.export.Dim("tokens", min=1, max=POSITIONS - 1)
    args: tuple[Any, ...] = (torch.randn(1, 2, DIM), torch.tensor([0, 1]))
    shapes: tuple[Any, ...] = ({1: tokens}, {0: tokens})
    if caller_cache:
        args, shapes = (*args, torch.zeros(1, KV_HEADS, POSITIONS, DIM)), (*shapes, None)
    return export_model(module, args, strict=False, dynamic_shapes=shapes)


def test_custom_sdpa_reads_the_cache_stored_positions_first_and_answers_as_eager() -> None:
    """Both caches (one persistent, one not) are stored ``[1, positions, kv_heads, dim]`` with
    the same values, no transpose of a whole cache is left, and a 5-token prompt then one
    decoded token give eager's outputs and caches."""
    module = Layer().eval()
    eager = copy.deepcopy(module)
    exported = _export(module)
    report = attention_to_runner_kernels(exported)
    assert report.rewritten == ["custom_sdpa"] and report.refused == {}
    assert exported.constants["key_cache"].shape == (1, POSITIONS, KV_HEADS, DIM)
    assert exported.state_dict["value_cache"].shape == (1, POSITIONS, KV_HEADS, DIM)
    for node in exported.graph_module.graph.nodes:
        if node.target is torch.ops.aten.transpose.int:
            assert tuple(node.meta["val"].shape)[1] != POSITIONS, node.format_node()
    runnable = exported.module()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for start, n in ((0, 5), (5, 1)):
            x = torch.randn(1, n, DIM, generator=generator)
            positions = torch.arange(start, start + n)
            torch.testing.assert_close(runnable(x, positions), eager(x, positions), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runnable.key_cache, eager.key_cache.transpose(1, 2))
    torch.testing.assert_close(runnable.value_cache, eager.value_cache.transpose(1, 2))


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("slice-assigned", "the key is not a cache written by index_copy_"),
        ("converted", "the key is not a cache transposed (1, 2) for this attention alone"),
        ("cache-read-twice", "the key's cache 'b_key_cache' is read by more than this attention"),
    ],
)
def test_each_custom_sdpa_refusal_fires_and_leaves_the_graph_unchanged(variant: str, reason: str) -> None:
    exported = _export(Layer(variant).eval())
    before = [n.format_node() for n in exported.graph_module.graph.nodes]
    report = attention_to_runner_kernels(exported)
    assert report.rewritten == []
    assert report.refused == {"custom_sdpa": reason}
    assert [n.format_node() for n in exported.graph_module.graph.nodes] == before


def test_a_cache_the_caller_passes_is_refused_naming_it() -> None:
    exported = _export(CallerCache().eval(), caller_cache=True)
    report = attention_to_runner_kernels(exported)
    assert report.rewritten == []
    assert report.refused == {"custom_sdpa": "the key's cache 'cache' is not a buffer the program owns"}
