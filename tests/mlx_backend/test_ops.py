"""Each op of the MLX table against eager PyTorch: one small module per op, all side by side
in one program lowered so that only the delegate runs, executed through the pybind-runtime on
seeded random inputs; each op's result is checked on its own."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.mlx_backend.lowering import lower_mlx

Fn = Callable[..., torch.Tensor]


class Op(torch.nn.Module):
    def __init__(self, fn: Fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


class Embed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx)


class Linear(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 3, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@dataclass(frozen=True)
class Case:
    module: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.Generator], tuple[torch.Tensor, ...]]


def _rand(*shape: int) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    return lambda g: (torch.randn(shape, generator=g),)


def _rand2(a: tuple[int, ...], b: tuple[int, ...]) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    return lambda g: (torch.randn(a, generator=g), torch.randn(b, generator=g))


def _op(fn: Fn, inputs: Callable[[torch.Generator], tuple[torch.Tensor, ...]]) -> Case:
    return Case(lambda: Op(fn), inputs)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _mask(x: torch.Tensor) -> torch.Tensor:
    keep = torch.arange(6).view(1, 6) <= torch.arange(6).view(6, 1)
    return torch.where(keep, x, float("-inf")).softmax(-1)


def _splits(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # both parts read
    middle = torch.split(x, 3, dim=-1)[1]  # one part of three read
    first_row = torch.unbind(x, 0)[0]
    return gate * up + middle.sum(-1, keepdim=True) + first_row[:4]


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


CASES: dict[str, Case] = {
    "embedding": Case(Embed, lambda g: (torch.randint(0, 10, (2, 3), generator=g),)),
    "linear": Case(lambda: Linear(False), _rand(2, 5)),
    "linear_bias": Case(lambda: Linear(True), _rand(2, 5)),
    "matmul": _op(torch.matmul, _rand2((2, 3, 4), (2, 4, 5))),
    "mm": _op(torch.mm, _rand2((3, 4), (4, 2))),
    "add": _op(lambda a, b: a + b, _rand2((3, 4), (4,))),
    "sub": _op(lambda a, b: a - 2 * b, _rand2((3, 4), (3, 4))),
    "mul": _op(lambda a, b: a * b, _rand2((3, 4), (3, 1))),
    "div": _op(lambda a, b: a / (b.abs() + 1), _rand2((3, 4), (3, 4))),
    "rsub_scalar": _op(lambda a: 1.5 - a, _rand(3, 4)),
    "rms_norm": _op(_rms, _rand(2, 8)),
    "chunk_split_unbind": _op(_splits, _rand(2, 8)),
    "layer_norm": _op(
        lambda a, w, b: F.layer_norm(a, (8,), w, b, 1e-5),
        lambda g: (torch.randn(2, 3, 8, generator=g) * 3 + 1, torch.randn(8, generator=g), torch.randn(8, generator=g)),
    ),
    "layer_norm_plain": _op(lambda a: F.layer_norm(a, (8,)), _rand(2, 8)),
    "layer_norm_two_dims": _op(
        lambda a, w: F.layer_norm(a, (3, 4), w, None, 1e-3),
        lambda g: (torch.randn(2, 3, 4, generator=g), torch.randn(3, 4, generator=g)),
    ),
    "sqrt_exp_neg": _op(lambda a: torch.sqrt(a.abs()) + torch.exp(-a), _rand(3, 4)),
    "softmax": _op(lambda a: torch.softmax(a, dim=-1), _rand(2, 3, 5)),
    "silu": _op(F.silu, _rand(3, 4)),
    "gelu": _op(F.gelu, _rand(3, 4)),
    "gelu_tanh": _op(lambda a: F.gelu(a, approximate="tanh"), _rand(3, 4)),
    "cos_sin": _op(lambda a: torch.cos(a) * torch.sin(2 * a), _rand(3, 4)),
    "sigmoid_tanh_relu": _op(lambda a: torch.sigmoid(a) + torch.tanh(a) + F.relu(a), _rand(3, 4)),
    "reshape_view": _op(lambda a: a.reshape(4, 6).view(2, 12) * 1.0, _rand(2, 3, 4)),
    "permute": _op(lambda a: a.permute(2, 0, 1) * 2.0, _rand(2, 3, 4)),
    "transpose": _op(lambda a: a.transpose(1, 2) + 1.0, _rand(2, 3, 4)),
    "expand": _op(lambda a: a.expand(2, 3, 4) * 1.0, _rand(1, 3, 1)),
    "unsqueeze_squeeze": _op(lambda a: a.unsqueeze(1).squeeze(0) * 1.0, _rand(1, 4)),
    "slice": _op(lambda a: a[:, 1:5:2] * 1.0, _rand(3, 6)),
    "select": _op(lambda a: a[1] * 1.0, _rand(3, 6)),
    "cat": _op(lambda a, b: torch.cat([a, b], dim=1), _rand2((2, 3), (2, 5))),
    "where_mask": _op(_mask, _rand(6, 6)),
    "compare": _op(lambda a, b: (a < b).float() + (a >= 0.5).float(), _rand2((3, 4), (3, 4))),
    "clamp": _op(lambda a: a.clamp(-0.5, 0.5) + a.clamp(min=0.1), _rand(3, 4)),
    "sum_amax": _op(lambda a: a.sum(-1) + a.amax(-1), _rand(3, 4)),
    "sdpa": _op(_sdpa, lambda g: tuple(torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))),
    "to_dtype": _op(lambda a: (a * 10).to(torch.int32).to(torch.float32), _rand(3, 4)),
    "arange_full": _op(lambda a: a + torch.arange(4) + torch.full((4,), 2.0), _rand(4)),
    "index_select": _op(
        lambda a, i: a.index_select(1, i) * 1.0,
        lambda g: (torch.randn(2, 5, 3, generator=g), torch.tensor([4, 0, 4])),
    ),
    "index_copy": _op(
        lambda a, i, s: a.index_copy(1, i, s) * 1.0,
        lambda g: (torch.randn(2, 5, generator=g), torch.tensor([4, 0]), torch.randn(2, 2, generator=g)),
    ),
    "index_put": _op(
        lambda a, i, s: a.index_put((i,), s) * 1.0,
        lambda g: (torch.randn(5, 3, generator=g), torch.tensor([-1, 2]), torch.randn(2, 3, generator=g)),
    ),
    "index_put_accumulate": _op(
        lambda a, i, s: a.index_put((i,), s, accumulate=True) * 1.0,
        lambda g: (torch.randn(5, 3, generator=g), torch.tensor([1, 1]), torch.randn(2, 3, generator=g)),
    ),
    "slice_scatter": _op(
        lambda a, s: torch.slice_scatter(a, s, dim=1, start=-5, end=-1, step=2) * 1.0,
        lambda g: (torch.randn(3, 6, generator=g), torch.randn(3, 2, generator=g)),
    ),
}


NAMES = sorted(CASES)
# Each case's inputs, from a generator seeded by its name.
INPUTS = {name: CASES[name].inputs(torch.Generator().manual_seed(sum(map(ord, name)))) for name in NAMES}


class EveryCase(torch.nn.Module):
    """Every case side by side in one program, each on its own inputs, returning each
    case's result: one lowering serves every case's test (lowering, not running the ops, is
    most of such a test's time)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cases = torch.nn.ModuleList(CASES[name].module() for name in NAMES)
        self.counts = [len(INPUTS[name]) for name in NAMES]

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs, at = [], 0
        for case, count in zip(self.cases, self.counts, strict=True):
            outputs.append(case(*args[at : at + count]))
            at += count
        return tuple(outputs)


@dataclass
class EveryCaseRun:
    """What one lowering and run of :class:`EveryCase` gave, shared by every case's test."""

    module: EveryCase
    only_delegate_runs: bool
    graph_targets: list[str]
    outputs: list[torch.Tensor]


@pytest.fixture(scope="module")
def every_case() -> EveryCaseRun:
    module = EveryCase()
    args = [t for name in NAMES for t in INPUTS[name]]
    lowered = lower_mlx(module, tuple(args))
    return EveryCaseRun(module, lowered.only_delegate_runs(), lowered.graph_targets(), lowered.method().execute(args))


@pytest.mark.parametrize("name", NAMES)
def test_op_runs_inside_the_delegate_and_matches_eager(name: str, every_case: EveryCaseRun) -> None:
    assert every_case.only_delegate_runs, every_case.graph_targets
    index = NAMES.index(name)
    out = every_case.outputs[index]
    with torch.no_grad():
        expected = every_case.module.cases[index](*INPUTS[name])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(out.float().abs().sum()))


def test_index_select_out_of_range_raises_naming_the_index_and_returns_nothing() -> None:
    """MLX's take would read past the end silently; ATen raises, so the delegate does too."""
    from writeback_pybind_runtime import DelegateError

    module = Op(lambda a, i: a.index_select(0, i) * 1.0)
    args = (torch.randn(4, 3), torch.tensor([1, 2]))
    method = lower_mlx(module, args).method()
    with pytest.raises(
        DelegateError,
        match=r"index_select: index 4 at position 1 is out of range for dimension 0 "
        r"of size 4",
    ):
        method.execute([args[0], torch.tensor([0, 4])])
    # The method still works after the refused call.
    (out,) = method.execute(list(args))
    torch.testing.assert_close(out, args[0][[1, 2]])
