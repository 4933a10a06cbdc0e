"""Hazards of the attention window (``writeback_mlx_backend.window``), each answered as eager.

- Keyword arguments: ``add(scores, mask, alpha=-1)`` subtracts the ``-inf`` mask, so the
  masked columns are ``+inf`` and eager's softmax is NaN; a window that ignored ``alpha``
  would compute only the allowed columns and answer finite numbers.
- Masked cache rows holding ``inf`` or ``nan``: eager's masked score is ``nan`` (or its zero
  weight times the row is), so eager answers NaN; a window that never reads those rows
  would answer finite numbers.

Real export and lowering, real pybind-runtime, real MLX; every value compared with eager
PyTorch (NaN where eager gives NaN).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from writeback.zoo import CallerCacheDecoder, DecoderConfig, TinyDecoder

from tests.mlx_backend.lowering import lower_mlx

ATOL = RTOL = 1e-4
SIZE, WIDTH = 80, 8


class Attention(nn.Module):
    """One head over a cache in buffers, masked to the written positions; ``alpha`` is how
    the mask is added (``add(scores, mask, alpha=alpha)``)."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor

    def __init__(self, alpha: float = 1.0) -> None:
        super().__init__()
        self.alpha = alpha
        self.register_buffer("k", torch.zeros(1, SIZE, WIDTH))
        self.register_buffer("v", torch.zeros(1, SIZE, WIDTH))
        self.register_buffer("slots", torch.arange(SIZE))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k.index_copy_(1, pos, x)
        self.v.index_copy_(1, pos, 2 * x + 1)
        mask = torch.where(self.slots <= pos, 0.0, -math.inf)
        scores = torch.add((x @ self.k.transpose(1, 2)) / 3.0, mask, alpha=self.alpha)
        return torch.softmax(scores, dim=-1) @ self.v


def _x(position: int) -> torch.Tensor:
    return torch.randn(1, 1, WIDTH, generator=torch.Generator().manual_seed(position))


def _matches_eager(mine: nn.Module, eager: nn.Module, positions: list[int]) -> list[str]:
    lowered = lower_mlx(mine, (torch.ones(1, 1, WIDTH), torch.tensor([0])))
    assert lowered.only_delegate_runs()
    method, delegate = lowered.method(), lowered.delegate()
    for position in positions:
        x, pos = _x(position), torch.tensor([position])
        (out,) = method.execute([x, pos])
        with torch.no_grad():
            expected = eager(x, pos)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL, equal_nan=True, msg=f"position {position}")
    return list(delegate.execution_paths)


def test_window_hazard_add_with_alpha_is_not_followed_and_answers_nan_as_eager() -> None:
    eager = Attention(alpha=-1.0)
    with torch.no_grad():
        # Worked out: the masked columns hold +inf, so every softmax weight is NaN.
        assert torch.isnan(eager(_x(3), torch.tensor([3]))).all()
    paths = _matches_eager(Attention(alpha=-1.0), Attention(alpha=-1.0), [0, 3, 40])
    assert "bounded by" not in paths[0], paths  # no window: the whole axis is computed


def test_window_hazard_alpha_one_still_bounds_attention() -> None:
    """``alpha=1`` is the plain add: the window still applies, and matches eager."""
    paths = _matches_eager(Attention(alpha=1.0), Attention(alpha=1.0), [0, 3, 40])
    assert paths[0].startswith("compiled; attention over 1 masked softmax(es) bounded by pos"), paths


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_window_hazard_masked_rows_holding_non_finite_values_answer_as_eager(where: str, bad: float) -> None:
    """Rows 60..79 of one cache hold ``bad`` before any call: masked out at every position
    below 60, and never read by a window of 32 or 48 columns."""

    def made() -> Attention:
        module = Attention()
        getattr(module, where)[:, 60:] = bad
        return module

    eager = made()
    with torch.no_grad():
        found = eager(_x(3), torch.tensor([3]))
    # Worked out: a masked row of inf, -inf or nan makes the score nan (or +inf), or its zero
    # weight times the row nan, for some column of the output at least.
    assert torch.isnan(found).any()
    paths = _matches_eager(made(), made(), [0, 3, 31, 40, 47])
    assert paths[0].startswith("compiled; attention over 1 masked softmax(es)"), paths


def test_window_hazard_caller_caches_with_nan_in_unwritten_rows_answer_nan_as_eager() -> None:
    """A caller's caches from uninitialized memory may hold NaN in the rows not written yet;
    eager's decoder then answers NaN, and so must the delegate: the per-call scan of the
    rows past the 32 a window reads finds them, and the call runs unbounded."""
    cfg = DecoderConfig(vocab=32, dim=64, heads=4, max_seq=64, layers=2, hidden=128)
    mine, eager = CallerCacheDecoder(cfg), CallerCacheDecoder(cfg)
    example = [torch.zeros(cfg.cache_shape) for _ in range(2 * cfg.layers)]
    lowered = lower_mlx(mine, (torch.tensor([[1]]), torch.tensor([0]), *example))
    method, delegate = lowered.method(), lowered.delegate()
    caches = [torch.zeros(cfg.cache_shape) for _ in range(2 * cfg.layers)]
    for cache in caches:
        cache[:, :, 40:] = math.nan  # past every position called, and past the 32 columns read
    expected_caches = [c.clone() for c in caches]
    for position in range(3):
        tokens, pos = torch.tensor([[position + 1]]), torch.tensor([position])
        *_, logits = method.execute([tokens, pos, *caches])
        with torch.no_grad():
            expected = eager(tokens, pos, *expected_caches)
        assert torch.isnan(expected).all()  # worked out: NaN rows are masked, not removed
        torch.testing.assert_close(logits, expected, equal_nan=True, msg=f"position {position}")
        for cache, want in zip(caches, expected_caches, strict=True):
            torch.testing.assert_close(cache, want, equal_nan=True)
        # The scan found NaN past the 32 columns a window reads: the call ran exact.
        assert (delegate.finite_scans, delegate.exact_calls) == (position + 1, position + 1), position


class WhereAttention(Attention):
    """The masked scores pass through ``where(allowed, scores, -inf)``: a masked column's score
    (NaN or inf when its key row holds inf) feeds only the branch ``where`` does not take."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k.index_copy_(1, pos, x)
        self.v.index_copy_(1, pos, 2 * x + 1)
        allowed = self.slots <= pos
        mask = torch.where(allowed, 0.0, -math.inf)
        scores = torch.where(allowed, (x @ self.k.transpose(1, 2)) / 3.0 + mask, -math.inf) + mask
        return torch.softmax(scores, dim=-1) @ self.v


def test_window_hazard_removed_rows_feeding_an_unused_where_branch_answer_finite_as_eager() -> None:
    """Rows 60..79 of the key cache hold inf: eager's masked scores are NaN or inf, but the
    ``where`` takes -inf there, so eager's answer is finite. A window that poisons its
    answer wherever a removed row is not finite answers NaN; ours is eager's."""

    def made() -> WhereAttention:
        module = WhereAttention()
        module.k[:, 60:] = math.inf
        return module

    eager = made()
    with torch.no_grad():
        assert torch.isfinite(eager(_x(3), torch.tensor([3]))).all()  # worked out above
    paths = _matches_eager(made(), made(), [0, 3, 31, 40, 47])
    assert paths[0].startswith("compiled; attention over 1 masked softmax(es)"), paths


def test_window_hazard_nan_written_by_a_call_into_a_delegate_owned_cache_answers_nan_as_eager() -> None:
    """A call at position 50 writes NaN into row 50 of both caches (the cache's flag goes
    down); the position is then rewound to 3, where row 50 is masked and past the 32 rows a
    window reads. Eager's masked score there is NaN, so eager answers NaN; a delegate that
    trusted its initial check would answer finite numbers."""
    lowered = lower_mlx(Attention(), (torch.ones(1, 1, WIDTH), torch.tensor([0])))
    method, delegate = lowered.method(), lowered.delegate()
    eager = Attention()
    bad = torch.full((1, 1, WIDTH), math.nan)
    for x, position in [(_x(0), 0), (_x(1), 1), (bad, 50), (_x(3), 3), (_x(4), 4)]:
        pos = torch.tensor([position])
        (out,) = method.execute([x, pos])
        with torch.no_grad():
            expected = eager(x, pos)
        # Worked out: row 50 is NaN from the third call on, allowed at 50 and masked at 3 and 4.
        assert bool(torch.isnan(expected).all()) == (position >= 3), position
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL, equal_nan=True, msg=f"position {position}")
    # The calls at 0 and 1 ran bounded (the caches known finite), those at 3 and 4 exact.
    assert list(delegate.attention_lengths)[-5:] == [32, 32, 64, 80, 80]
    assert (delegate.exact_calls, delegate.finite_scans) == (2, 0)


def test_window_clean_decoder_steps_scan_no_removed_rows_of_delegate_owned_caches() -> None:
    """Over clean steps a decoder whose caches are buffers runs every call bounded, knows the
    removed rows finite from its flags, and never scans them; with the caches the caller's,
    each call scans them once (the caller may have written anything) and still runs bounded."""
    cfg = DecoderConfig(vocab=32, dim=64, heads=4, max_seq=80, layers=2, hidden=128)
    lowered = lower_mlx(TinyDecoder(cfg, seed=3), (torch.tensor([[1]]), torch.tensor([0])))
    method, delegate = lowered.method(), lowered.delegate()
    eager = TinyDecoder(cfg, seed=3)
    for position in range(40):
        tokens, pos = torch.tensor([[(5 * position + 2) % 32]]), torch.tensor([position])
        (logits,) = method.execute([tokens, pos])
        with torch.no_grad():
            torch.testing.assert_close(logits, eager(tokens, pos), rtol=RTOL, atol=ATOL, msg=f"position {position}")
    assert (delegate.exact_calls, delegate.finite_scans) == (0, 0)
    assert list(delegate.attention_lengths)[-40:] == [32] * 32 + [48] * 8  # worked out: position + 1, rounded up

    caller = CallerCacheDecoder(cfg, seed=3)
    example = [torch.zeros(cfg.cache_shape) for _ in range(2 * cfg.layers)]
    lowered = lower_mlx(caller, (torch.tensor([[1]]), torch.tensor([0]), *example))
    method, delegate = lowered.method(), lowered.delegate()
    assert "callers' tensors" in delegate.execution_paths[-1] and "scanned" in delegate.execution_paths[-1]
    caches = [torch.zeros(cfg.cache_shape) for _ in range(2 * cfg.layers)]
    for position in range(3):
        method.execute([torch.tensor([[position + 1]]), torch.tensor([position]), *caches])
    assert (delegate.exact_calls, delegate.finite_scans) == (0, 3)
    assert list(delegate.attention_lengths)[-3:] == [32, 32, 32]
