"""RMSNorm chains run as one ``mx.fast.rms_norm`` step (``writeback_mlx_backend.fast``):
the forms real models export are each fused, a chain whose inner value is read elsewhere
or whose square is another power is left alone, a weight of another shape takes the chain's
own ops, and every case computes what eager PyTorch does."""

from __future__ import annotations

import pytest
import torch

from tests.mlx_backend.lowering import lower_mlx

DIM = 8


class PowNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm: ``x.pow(2).mean(-1, keepdim=True)``, weight first."""

    def __init__(self, eps: float, weight_shape: tuple[int, ...] | None = (DIM,)) -> None:
        super().__init__()
        self.eps = eps
        self.weight = None if weight_shape is None else torch.nn.Parameter(torch.rand(weight_shape) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if self.weight is None else self.weight * y


class SquareNorm(torch.nn.Module):
    """ExecuTorch's Llama example: ``(x * x).mean(-1, keepdim=True)``, weight last."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.rand(DIM) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class NormAlsoReturnsScale(PowNorm):
    """The chain's inner value ``rsqrt(...)`` is an output too: it must stay a step."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x * scale), scale


class FourthPowerNorm(PowNorm):
    """Not an RMSNorm: the same chain, but the mean is of ``x ** 4``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(4).mean(-1, keepdim=True) + self.eps))


def _run(module: torch.nn.Module, x: torch.Tensor) -> tuple[str, list[torch.Tensor], list[torch.Tensor]]:
    """The delegate's execution path, its outputs and eager's, for one call on ``x``."""
    lowered = lower_mlx(module, (x,))
    assert lowered.only_delegate_runs()
    method = lowered.method()
    (path,) = lowered.delegate().execution_paths
    got = [o.clone() for o in method.execute([x])]
    with torch.no_grad():
        expected = module(x)
    return path, got, list(expected) if isinstance(expected, tuple) else [expected]


def _x() -> torch.Tensor:
    # Rows of very different sizes: a wrong eps or a wrong axis shows in the output.
    return torch.tensor([[0.01 * (i + 1) * (-1) ** i for i in range(DIM)], [float(3 * i - 7) for i in range(DIM)]])


@pytest.mark.parametrize(
    "module",
    [PowNorm(eps=0.5), PowNorm(eps=1e-6, weight_shape=None), SquareNorm(eps=0.25)],
    ids=["pow-weight-first", "pow-no-weight", "square-weight-last"],
)
def test_rms_norm_as_models_export_it_is_one_fused_step_and_matches_eager(module: torch.nn.Module) -> None:
    path, got, expected = _run(module.eval(), _x())
    assert path == "compiled; 1 RMSNorm(s) as mx.fast.rms_norm"
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_weight_of_another_shape_is_fused_but_runs_the_chain_and_matches_eager() -> None:
    """A weight per row and column (``[2, DIM]``) is not a norm weight: the fused step runs
    the chain's own ops, so each row gets its own weights, as in eager."""
    path, got, expected = _run(PowNorm(eps=0.5, weight_shape=(2, DIM)).eval(), _x())
    assert path == "compiled; 1 RMSNorm(s) as mx.fast.rms_norm"
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "module", [NormAlsoReturnsScale(eps=0.5), FourthPowerNorm(eps=0.5)], ids=["inner-value-returned", "fourth-power"]
)
def test_chain_that_is_not_a_whole_rms_norm_is_left_as_steps_and_matches_eager(module: torch.nn.Module) -> None:
    path, got, expected = _run(module.eval(), _x())
    assert path == "compiled"
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
