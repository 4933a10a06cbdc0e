"""Attention written out as PyTorch exports it, run as one
``mx.fast.scaled_dot_product_attention`` step (``writeback_mlx_backend.fast``): the forms
real models export are fused (a hand-written softmax over scaled scores, PyTorch's SDPA with
its safe softmax, grouped-query heads), the kernel is what runs, a fully masked query row
gives zeros as eager does, an attention whose scores are read elsewhere is left alone, and
every case computes what eager PyTorch does. Real export and lowering, real pybind-runtime,
real MLX."""

from __future__ import annotations

from typing import Any, get_args

import pytest
import torch
import torch.nn.functional as F
from writeback.session import Eager, Session, assemble, compare, lower_case
from writeback_core.registry import load_registry
from writeback_core.types import Stage
from writeback_decoders.et_llama import ETLlamaConfig, et_llama_case
from writeback_mlx_backend import MLXDelegate

from tests.mlx_backend.lowering import count_kernel_calls, lower_mlx
from tests.mlx_backend.lowering import registry as mlx_registry

ATOL = RTOL = 1e-5
FUSED = "attention(s) as mx.fast.scaled_dot_product_attention"


class Sdpa(torch.nn.Module):
    """``F.scaled_dot_product_attention`` with an additive mask, ``kv_heads`` key and value
    heads repeated to ``heads`` (as Hugging Face's ``repeat_kv`` does)."""

    def __init__(self, heads: int = 4, kv_heads: int = 4, scale: float | None = None) -> None:
        super().__init__()
        self.repeat, self.scale = heads // kv_heads, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        k, v = k.repeat_interleave(self.repeat, dim=1), v.repeat_interleave(self.repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


class ScoresToo(torch.nn.Module):
    """Hand-written attention that also returns its scores: not one kernel's work."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Any:
        scores = q @ k.transpose(2, 3) / 2.0 + mask
        return torch.softmax(scores, dim=-1) @ v, scores


def _inputs(heads: int, kv_heads: int, t: int = 3, s: int = 6, d: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(1, 1, t, s)
    mask[..., :, s - 2 :] = float("-inf")  # every query ignores the last two keys
    return [
        torch.randn(1, heads, t, d, generator=g),
        torch.randn(1, kv_heads, s, d, generator=g),
        torch.randn(1, kv_heads, s, d, generator=g),
        mask,
    ]


def _run(
    module: torch.nn.Module, inputs: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, Any], Any]:
    """The delegate's path, the MLX kernel's calls while loading and running once (see
    ``count_kernel_calls``), and the outputs."""
    calls = count_kernel_calls(monkeypatch, "scaled_dot_product_attention")
    lowered = lower_mlx(module, tuple(inputs))
    assert lowered.only_delegate_runs()
    method = lowered.method()
    outputs = method.execute(inputs)
    (path,) = lowered.delegate().execution_paths
    return path, calls, outputs


@pytest.mark.parametrize(("heads", "kv_heads", "scale"), [(4, 4, None), (4, 2, None), (2, 1, 0.3)])
def test_pytorch_sdpa_runs_as_one_kernel_and_matches_eager(
    heads: int, kv_heads: int, scale: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = Sdpa(heads, kv_heads, scale)
    inputs = _inputs(heads, kv_heads)
    path, calls, (out,) = _run(module, inputs, monkeypatch)
    assert path.endswith(f"; 1 {FUSED}"), path
    # q, then k and v with their own heads: repeated heads are not copied for the kernel.
    assert calls["n"] >= 1 and calls["shapes"][:3] == [(1, heads, 3, 4), (1, kv_heads, 6, 4), (1, kv_heads, 6, 4)]
    with torch.no_grad():
        torch.testing.assert_close(out, module(*inputs), rtol=RTOL, atol=ATOL)


def test_sdpa_is_one_kernel_without_the_scale_pass_the_delegate_moves_the_scale_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PyTorch's decomposed SDPA scales both ``q`` and ``K^T``; the kernel takes one scale. The
    MLX lowering runs no ``scale_smaller_operand`` pass (writeback-passes offers it to the stock
    runtime's lowerings only): the delegate's own ``preprocess`` moves the scale to the smaller
    operand, so the attention is still one kernel, computing what eager does."""
    registry = mlx_registry()
    ran = [p.name for stage in get_args(Stage) for p in registry.program_passes(stage, "mlx")]
    assert "scale_smaller_operand" not in ran and "functional_copies_as_views" in ran
    module, inputs = Sdpa(4, 2), _inputs(4, 2, s=9)
    calls = count_kernel_calls(monkeypatch, "scaled_dot_product_attention")
    lowered = lower_mlx(module, tuple(inputs), registry_=registry)
    assert lowered.only_delegate_runs()
    (out,) = lowered.method().execute(inputs)
    (path,) = lowered.delegate().execution_paths
    assert path.endswith(f"; 1 {FUSED}"), path
    assert calls["n"] >= 1 and calls["shapes"][:3] == [(1, 4, 3, 4), (1, 2, 9, 4), (1, 2, 9, 4)]
    with torch.no_grad():
        torch.testing.assert_close(out, module(*inputs), rtol=RTOL, atol=ATOL)


def test_a_query_row_masked_everywhere_gives_zeros_as_eager_does(monkeypatch: pytest.MonkeyPatch) -> None:
    module = Sdpa()
    inputs = _inputs(4, 4)
    inputs[3][..., 1, :] = float("-inf")  # query 1 may attend nowhere
    path, _, (out,) = _run(module, inputs, monkeypatch)
    assert path.endswith(f"; 1 {FUSED}"), path
    # Worked out by hand: PyTorch's safe softmax gives that row zero weights, so zeros.
    assert torch.equal(out[:, :, 1], torch.zeros(1, 4, 4))
    assert not torch.isnan(out).any()
    with torch.no_grad():
        torch.testing.assert_close(out, module(*inputs), rtol=RTOL, atol=ATOL)


def test_attention_whose_scores_are_an_output_keeps_its_ops_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    module = ScoresToo()
    inputs = _inputs(2, 2)
    path, calls, (out, scores) = _run(module, inputs, monkeypatch)
    assert FUSED not in path, path
    assert calls["n"] == 0
    with torch.no_grad():
        want, want_scores = module(*inputs)
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(scores, want_scores, rtol=RTOL, atol=ATOL)


def test_et_llama_runs_each_layers_attention_as_one_kernel_over_the_window_and_matches_eager() -> None:
    cfg = ETLlamaConfig(max_seq=72)
    case = et_llama_case(config=cfg)
    pipeline = assemble(load_registry(), "mlx")
    lowered = lower_case(case, pipeline)
    delegate = pipeline.delegates["WritebackMLXBackend"]
    assert isinstance(delegate, MLXDelegate)
    session = Session.open(pipeline, lowered)
    path = delegate.execution_paths[-1]
    assert path.startswith(f"compiled; attention over {cfg.layers} masked softmax(es)"), path
    assert path.endswith(f"; {cfg.layers} {FUSED}"), path
    eager = Eager(case)
    for step in range(40):
        check = compare(session.step(step), eager.step(step), session.state, eager.state)
        assert check.ok, (step, check.problems)
    assert list(delegate.attention_lengths)[-40:] == [32] * 32 + [48] * 8
