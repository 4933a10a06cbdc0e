"""Fusions (``writeback_mlx_backend.fast``) match a literal dim only as the axis it names at
the value's rank: ``dim=3`` is the last axis of a rank-4 tensor, not of a rank-5 one.

A rotary embedding's rotation written along dim 3 of a rank-5 ``x`` (``[1, H, A, 1, D]``, so
axis 3 has size 1) is not the rotation along the last axis that ``mx.fast.rope`` computes:
ATen halves the size-1 axis (``x[:, :, :, 4:]`` is empty), so the rotation is ``x`` itself.
Real export and lowering, real pybind-runtime, real MLX; compared with eager PyTorch or
ATen ops worked out on the same inputs.
"""

from __future__ import annotations

import torch
from executorch.exir.lowered_backend_module import LoweredBackendModule
from torch import nn
from writeback_mlx_backend import MLXDelegate
from writeback_mlx_backend.delegate_program import DelegateProgram

from tests.mlx_backend.lowering import lower_mlx

D = 8
SHAPE = (1, 2, 3, 1, D)


class Rank5Rope(nn.Module):
    """Hugging Face's rope for one position, with its rotation's dim written as 3."""

    inv_freq: torch.Tensor

    def __init__(self, rotate_dim: int) -> None:
        super().__init__()
        self.rotate_dim = rotate_dim
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D)))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        f = position.float() * self.inv_freq
        e = torch.cat([f, f], -1)
        cos, sin = e.cos().view(1, 1, 1, 1, D), e.sin().view(1, 1, 1, 1, D)
        h, dim = D // 2, self.rotate_dim
        before = (Ellipsis,) if dim == -1 else (slice(None),) * dim
        high, low = x[(*before, slice(h, None))], x[(*before, slice(None, h))]
        rotated = torch.cat([-high, low], dim=dim)
        return x * cos + rotated * sin


def _run(rotate_dim: int) -> str:
    lowered = lower_mlx(Rank5Rope(rotate_dim), (torch.ones(SHAPE), torch.tensor([0])))
    method = lowered.method()
    g = torch.Generator().manual_seed(0)
    for position in (0, 1, 17):
        x, pos = torch.randn(SHAPE, generator=g), torch.tensor([position])
        (out,) = method.execute([x, pos])
        with torch.no_grad():
            expected = Rank5Rope(rotate_dim)(x, pos)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=f"position {position}")
    (path,) = lowered.delegate().execution_paths
    return str(path)


def _blob(rotate_dim: int) -> DelegateProgram:
    lowered = lower_mlx(Rank5Rope(rotate_dim), (torch.ones(SHAPE), torch.tensor([0])))
    (module,) = [
        m for m in lowered.program.exported_program().graph_module.children() if isinstance(m, LoweredBackendModule)
    ]
    return DelegateProgram.from_bytes(bytes(module.processed_bytes))


def test_fast_rank_hazard_rotation_along_dim_3_of_rank_5_is_not_fused_and_answers_as_aten() -> None:
    """torch.export writes the last axis of a rank-5 tensor as 4, so this blob is written by
    hand: the exported rope with its rotation's slices and cat moved to dim 3."""
    program = _blob(-1)
    moved = 0
    for node in program.nodes:
        if node["op"] == "aten.slice_copy.Tensor" and node["args"][1] == 4:
            node["args"][1] = 3
            moved += 1
        if node["op"] == "aten.cat.default" and node["args"][0][0]["$v"] == "aten_neg_default":
            node["args"][1] = 3
            moved += 1
    assert moved == 3
    delegate = MLXDelegate()
    handle = delegate.init(program.to_bytes(), {})
    assert "mx.fast.rope" not in delegate.path(handle), delegate.path(handle)
    g = torch.Generator().manual_seed(1)
    for position in (0, 1, 17):
        x, out = torch.randn(SHAPE, generator=g), torch.empty(SHAPE)
        given = {"x": x, "position": torch.tensor([position])}
        delegate.execute(handle, [*(given[name] for name in program.inputs), out])
        e = torch.cat([position * Rank5Rope(-1).inv_freq] * 2).view(1, 1, 1, 1, D)
        # Worked out: along dim 3 (size 1) the high half is empty and the low half is x.
        rotated = torch.cat([-x[:, :, :, 4:], x[:, :, :, :4]], dim=3)
        assert torch.equal(rotated, x)
        torch.testing.assert_close(out, x * e.cos() + rotated * e.sin(), rtol=1e-5, atol=1e-5)


def test_fast_rank_rotation_along_the_last_axis_of_rank_5_is_fused_and_matches_eager() -> None:
    """Exported as dim 4, the last axis at rank 5: the rotation ``mx.fast.rope`` computes."""
    path = _run(-1)
    assert path.endswith("; 1 RoPE(s) as mx.fast.rope"), path
