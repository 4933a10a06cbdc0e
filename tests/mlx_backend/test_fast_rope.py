"""Rotary position embeddings as Hugging Face writes them (``LlamaRotaryEmbedding`` and
``apply_rotary_pos_emb`` from transformers itself), run as one ``mx.fast.rope`` step per
rotated tensor (``writeback_mlx_backend.fast``): fused for one position, positions near and
far match eager PyTorch, and a rope whose cos and sin are scaled (not what the kernel
computes) keeps its ops. Real export and lowering, real pybind-runtime, real MLX."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.mlx_backend.lowering import count_kernel_calls, lower_mlx

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

ATOL = RTOL = 1e-5
FUSED = "RoPE(s) as mx.fast.rope"


class HFRope(nn.Module):
    """q and k of one decode step rotated at ``position``, as Hugging Face's Llama does;
    ``scaling`` multiplies cos and sin (Hugging Face's ``attention_scaling``)."""

    def __init__(self, head_dim: int = 16, theta: float = 10000.0, scaling: float = 1.0) -> None:
        super().__init__()
        config = modeling_llama.LlamaConfig(
            hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta
        )
        self.rotary = modeling_llama.LlamaRotaryEmbedding(config=config)
        self.rotary.attention_scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, position: torch.Tensor) -> Any:
        cos, sin = self.rotary(q, position.view(1, 1))
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)


def _lowered(module: HFRope, head_dim: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, str, dict[str, int]]:
    calls = count_kernel_calls(monkeypatch, "rope")
    args = (torch.ones(1, 4, 1, head_dim), torch.ones(1, 2, 1, head_dim), torch.tensor([0]))
    lowered = lower_mlx(module, args)
    assert lowered.only_delegate_runs()
    method = lowered.method()
    (path,) = lowered.delegate().execution_paths
    return method, path, calls


@pytest.mark.parametrize(("head_dim", "theta"), [(16, 10000.0), (64, 500000.0), (128, 1000000.0)])
def test_hugging_face_rope_runs_as_one_kernel_per_tensor_and_matches_eager_near_and_far(
    head_dim: int, theta: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = HFRope(head_dim, theta)
    method, path, calls = _lowered(module, head_dim, monkeypatch)
    assert path.endswith(f"; 2 {FUSED}"), path
    g = torch.Generator().manual_seed(head_dim)
    for position in (0, 1, 17, 4095, 32767, 131071):
        q, k = torch.randn(1, 4, 1, head_dim, generator=g), torch.randn(1, 2, 1, head_dim, generator=g)
        before = calls["n"]
        q_out, k_out = method.execute([q, k, torch.tensor([position])])
        with torch.no_grad():
            want_q, want_k = module(q, k, torch.tensor([position]))
        torch.testing.assert_close(q_out, want_q, rtol=RTOL, atol=ATOL, msg=f"position {position}")
        torch.testing.assert_close(k_out, want_k, rtol=RTOL, atol=ATOL, msg=f"position {position}")
        assert calls["n"] == before  # the traced step replays; the kernel was traced at load
    assert calls["n"] >= 2


def test_a_rope_whose_cos_and_sin_are_scaled_keeps_its_ops_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    module = HFRope(scaling=0.5)
    method, path, calls = _lowered(module, 16, monkeypatch)
    assert FUSED not in path, path
    assert calls["n"] == 0
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16)
    q_out, k_out = method.execute([q, k, torch.tensor([9])])
    with torch.no_grad():
        want_q, want_k = module(q, k, torch.tensor([9]))
    torch.testing.assert_close(q_out, want_q, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(k_out, want_k, rtol=RTOL, atol=ATOL)
