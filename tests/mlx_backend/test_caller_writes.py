"""Writes into a caller's tensor on the MLX delegate's compiled path: a KV cache passed as an
input and written in place is read over the attention window only, the step is evaluated
once, and the written region is stored into the caller's memory afterwards. A call whose
writes or attention reach past the longest traced length, or a program that reads the write
whole, is interpreted. Real export and lowering, real pybind-runtime, real MLX; every value
compared with eager PyTorch or worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from writeback.zoo import CallerCacheDecoder, DecoderConfig
from writeback_mlx_backend import empty
from writeback_mlx_backend.window import lengths

from tests.mlx_backend.lowering import lower_mlx
from tests.mlx_backend.test_compiled import counted

ATOL = RTOL = 1e-4
SIZE = 64  # traced lengths 32 and 48; positions 48..63 attend over the whole axis
# Op calls are counted outside the runtime's store of the written regions (their keys are
# worked out on the host from the call's indices, as the interpreted path does at a write).
STORE = "_caller_regions"


def _caches(cfg: DecoderConfig, allocate: Any) -> list[torch.Tensor]:
    return [allocate(cfg.cache_shape) for _ in range(2 * cfg.layers)]


@pytest.mark.parametrize("allocate", [empty, torch.zeros], ids=["mlx-allocated", "torch-allocated"])
def test_decoder_with_caller_caches_runs_compiled_evaluates_once_and_its_caches_match_eager(
    allocate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = DecoderConfig(vocab=32, dim=64, heads=4, max_seq=SIZE, layers=2, hidden=128)
    mine, eager = CallerCacheDecoder(cfg), CallerCacheDecoder(cfg)
    lowered = lower_mlx(mine, (torch.tensor([[1]]), torch.tensor([0]), *_caches(cfg, torch.zeros)))
    assert lowered.only_delegate_runs()
    assert lowered.write_backs() == []  # every cache write is the delegate's, in place
    method, delegate = lowered.method(), lowered.delegate()
    (path,) = delegate.execution_paths
    assert path.startswith("compiled; attention over 2 masked softmax(es) bounded by input_pos"), path
    assert "4 write(s) into callers' tensors stored in place after the one evaluation" in path
    caches, expected_caches = _caches(cfg, allocate), _caches(cfg, torch.zeros)
    for position in range(SIZE):
        tokens, pos = torch.tensor([[(5 * position + 2) % 32]]), torch.tensor([position])
        evaluations = delegate.evaluations_total
        with counted(monkeypatch, STORE) as counts:
            *_, logits = method.execute([tokens, pos, *caches])
        with torch.no_grad():
            expected = eager(tokens, pos, *expected_caches)
        torch.testing.assert_close(logits, expected, rtol=RTOL, atol=ATOL, msg=f"position {position}")
        for index, (cache, want) in enumerate(zip(caches, expected_caches, strict=True)):
            torch.testing.assert_close(cache, want, rtol=RTOL, atol=ATOL, msg=f"cache {index}, position {position}")
        if position < lengths(SIZE)[-1]:
            # Compiled: one evaluation, attention over 32 or 48 positions, and no op run in
            # Python (but in the first call at 48, which traces that length).
            assert delegate.evaluations_total - evaluations == 1, position
            assert counts["op calls"] == 0 or position == 32, position
            assert delegate.attention_lengths[-1] == (32 if position < 32 else 48), position
        else:
            # Past the longest traced length the write would need the whole cache: interpreted.
            assert counts["op calls"] > 0, position


class CallerAttention(nn.Module):
    """One head of attention over a caller's cache, written at ``slot`` and masked by ``pos``.
    Also returns the cache's row 0 as this call found it (``clone`` of a slice, which the
    delegate reads as a view of the cache) and the row 0 the previous call found, kept in
    a buffer (a buffer set to a slice of the cache)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.register_buffer("slots", torch.arange(SIZE))
        self.register_buffer("before", torch.zeros(1, width))

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        previous = self.before * 1.0
        old = cache[:, 0].clone()
        self.before.copy_(cache[:, 0])
        cache.index_copy_(1, slot, x)
        mask = torch.where(self.slots <= pos, 0.0, float("-inf"))
        scores = (x @ cache.transpose(1, 2)) / 3.0 + mask
        return torch.softmax(scores, dim=-1) @ cache, old, previous


def _attention() -> tuple[Any, Any, CallerAttention]:
    mine, eager = CallerAttention(), CallerAttention()
    args = (torch.ones(1, 1, 8), torch.tensor([0]), torch.tensor([0]), torch.zeros(1, SIZE, 8))
    lowered = lower_mlx(mine, args)
    assert lowered.only_delegate_runs()
    return lowered.method(), lowered.delegate(), eager


def _x(seed: int) -> torch.Tensor:
    return torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(seed))


def test_reads_before_a_caller_write_see_the_old_row_in_outputs_and_state_and_match_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    method, delegate, eager = _attention()
    assert "1 write(s) into callers' tensors" in delegate.execution_paths[-1]
    cache, expected_cache = empty((1, SIZE, 8)), torch.zeros(1, SIZE, 8)
    # Row 0 as each call finds it, worked out by hand: zeros until step 0 writes slot 0,
    # then the x of the latest step that wrote slot 0.
    row0 = torch.zeros(1, 8)
    for step, (position, slot) in enumerate([(0, 0), (1, 1), (2, 0), (3, 3), (4, 0), (5, 5)]):
        x, pos, at = _x(step), torch.tensor([position]), torch.tensor([slot])
        with counted(monkeypatch, STORE) as counts:
            *_, out, old, previous = method.execute([x, pos, at, cache])
        with torch.no_grad():
            want_out, want_old, want_previous = eager(x, pos, at, expected_cache)
        assert counts["op calls"] == 0 and counts["eval"] == 1, step
        torch.testing.assert_close(old, row0, msg=f"step {step}")
        torch.testing.assert_close(old, want_old, msg=f"step {step}")
        torch.testing.assert_close(previous, want_previous, msg=f"step {step}")
        torch.testing.assert_close(out, want_out, rtol=RTOL, atol=ATOL, msg=f"step {step}")
        torch.testing.assert_close(cache, expected_cache, msg=f"step {step}")
        if slot == 0:
            row0 = x.reshape(1, 8)


def test_a_write_past_the_mask_picks_a_longer_length_or_the_interpreted_path_and_matches_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    method, delegate, eager = _attention()
    cache, expected_cache = empty((1, SIZE, 8)), torch.zeros(1, SIZE, 8)
    # (mask position, write slot, the length worked out by hand: the smallest of 32 and 48
    # above both; None when the slot is past 48 and the call is interpreted).
    for step, (position, slot, length) in enumerate([(3, 3, 32), (2, 40, 48), (5, 60, None), (6, 31, 32)]):
        x, pos, at = _x(10 + step), torch.tensor([position]), torch.tensor([slot])
        calls = len(delegate.attention_lengths)
        with counted(monkeypatch, STORE) as counts:
            *_, out, _, _ = method.execute([x, pos, at, cache])
        with torch.no_grad():
            want, *_ = eager(x, pos, at, expected_cache)
        torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL, msg=f"step {step}")
        torch.testing.assert_close(cache, expected_cache, msg=f"step {step}")
        if length is None:
            assert counts["op calls"] > 0 and len(delegate.attention_lengths) == calls, step
        else:
            assert counts["eval"] == 1 and delegate.attention_lengths[-1] == length, step
            assert counts["op calls"] == 0 or step == 1, step  # step 1 traces length 48


def test_a_caller_write_index_out_of_range_raises_and_leaves_the_cache_and_state_unchanged() -> None:
    method, _, eager = _attention()
    cache, expected_cache = empty((1, SIZE, 8)), torch.zeros(1, SIZE, 8)
    method.execute([_x(0), torch.tensor([0]), torch.tensor([0]), cache])
    with torch.no_grad():
        eager(_x(0), torch.tensor([0]), torch.tensor([0]), expected_cache)
    before = cache.clone()
    with pytest.raises(Exception, match=r"index_copy: index 64 .*out of range for dimension 1 of size 64"):
        method.execute([_x(1), torch.tensor([1]), torch.tensor([SIZE]), cache])
    assert torch.equal(cache, before)
    # The next call goes on from the old cache and buffer.
    *_, out, old, previous = method.execute([_x(2), torch.tensor([1]), torch.tensor([1]), cache])
    with torch.no_grad():
        want, want_old, want_previous = eager(_x(2), torch.tensor([1]), torch.tensor([1]), expected_cache)
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(old, want_old)
    torch.testing.assert_close(previous, want_previous)
    torch.testing.assert_close(cache, expected_cache)


class ReadsWhole(CallerAttention):
    """Also sums the written cache whole: only the interpreted path can store that write."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, *_ = super().forward(x, pos, slot, cache)
        return out, cache.sum(1)


def test_a_program_that_reads_the_written_cache_whole_is_interpreted_says_why_and_matches_eager() -> None:
    mine, eager = ReadsWhole(), ReadsWhole()
    lowered = lower_mlx(mine, (torch.ones(1, 1, 8), torch.tensor([0]), torch.tensor([0]), torch.zeros(1, SIZE, 8)))
    method, delegate = lowered.method(), lowered.delegate()
    (path,) = delegate.execution_paths
    assert path.startswith("interpreted: it writes a caller's tensor in place, and "), path
    assert "over its whole axis" in path, path
    cache, expected_cache = empty((1, SIZE, 8)), torch.zeros(1, SIZE, 8)
    for step in range(3):
        x, pos = _x(step), torch.tensor([step])
        *_, out, total = method.execute([x, pos, pos, cache])
        with torch.no_grad():
            want, want_total = eager(x, pos, pos, expected_cache)
        torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(total, want_total, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(cache, expected_cache)


class PutAttention(nn.Module):
    """Two heads over a caller's key and value caches written with ``cache[:, :, slot] = ...``
    (``index_put``), masked by ``pos``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("slots", torch.arange(SIZE))

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        keys[:, :, slot] = x
        values[:, :, slot] = 2.0 * x - 1.0
        mask = torch.where(self.slots <= pos, 0.0, float("-inf"))
        scores = x @ keys.transpose(2, 3) / 2.0 + mask
        return torch.softmax(scores, dim=-1) @ values


def test_random_positions_and_slots_with_index_put_caches_match_eager_on_either_path() -> None:
    """Forty calls at positions and slots drawn from a seeded generator (jumping back, the same
    slot twice, slots past the mask and past the longest traced length): every output and
    both caches match eager PyTorch after every call, compiled or interpreted."""
    mine, eager = PutAttention(), PutAttention()
    shape = (1, 2, SIZE, 4)
    lowered = lower_mlx(
        mine, (torch.ones(1, 2, 1, 4), torch.tensor([0]), torch.tensor([0]), torch.zeros(shape), torch.zeros(shape))
    )
    method, delegate = lowered.method(), lowered.delegate()
    assert "2 write(s) into callers' tensors" in delegate.execution_paths[-1], delegate.execution_paths[-1]
    keys, values = empty(shape), torch.zeros(shape)  # one shared with MLX, one copied in
    want_keys, want_values = torch.zeros(shape), torch.zeros(shape)
    draw = torch.Generator().manual_seed(5)
    compiled = 0
    for step in range(40):
        position = int(torch.randint(0, SIZE, (1,), generator=draw))
        slot = position if step % 3 else int(torch.randint(0, SIZE, (1,), generator=draw))
        x = torch.randn(1, 2, 1, 4, generator=draw)
        calls = len(delegate.attention_lengths)
        *_, out = method.execute([x, torch.tensor([position]), torch.tensor([slot]), keys, values])
        with torch.no_grad():
            want = eager(x, torch.tensor([position]), torch.tensor([slot]), want_keys, want_values)
        where = f"step {step}: position {position}, slot {slot}"
        torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL, msg=where)
        torch.testing.assert_close(keys, want_keys, msg=where)
        torch.testing.assert_close(values, want_values, msg=where)
        compiled += len(delegate.attention_lengths) - calls
    assert 10 < compiled < 40  # both paths ran
