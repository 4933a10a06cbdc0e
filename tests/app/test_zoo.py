"""The zoo's decoder with sliding-window attention, against hand-worked attention in eager."""

from __future__ import annotations

import pytest
import torch
from writeback.zoo import CallerCacheDecoder, DecoderConfig


def _steps(cfg: DecoderConfig, count: int) -> list[torch.Tensor]:
    model = CallerCacheDecoder(cfg, seed=3).eval()
    caches = [torch.zeros(cfg.cache_shape) for _ in range(2 * cfg.layers)]
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab, (count,), generator=gen)
    with torch.no_grad():
        return [model(tokens[i].view(1, 1), torch.tensor([i]), *caches) for i in range(count)]


def test_window_covering_every_position_so_far_equals_full_attention() -> None:
    full = _steps(DecoderConfig(max_seq=16), 6)
    windowed = _steps(DecoderConfig(max_seq=16, window=8), 6)
    for step, (a, b) in enumerate(zip(full, windowed, strict=True)):
        torch.testing.assert_close(b, a, msg=f"step {step}")


def test_window_drops_positions_older_than_the_window() -> None:
    full = _steps(DecoderConfig(max_seq=16), 6)
    windowed = _steps(DecoderConfig(max_seq=16, window=3), 6)
    for step in range(3):  # steps 0..2 see positions 0..step in both
        torch.testing.assert_close(windowed[step], full[step])
    assert not torch.allclose(windowed[5], full[5])  # step 5 sees 3..5 only


def test_window_of_one_attends_to_the_current_token_only() -> None:
    """Softmax over one position is 1: the attention output is that token's own V, worked out here."""
    cfg = DecoderConfig(max_seq=8, window=1)
    model = CallerCacheDecoder(cfg, seed=3).eval()
    caches = [torch.zeros(cfg.cache_shape) for _ in range(2)]
    with torch.no_grad():
        model(torch.tensor([[5]]), torch.tensor([0]), *caches)  # fill position 0
        token = torch.tensor([[9]])
        out = model(token, torch.tensor([1]), *caches)
        block = model.blocks[0]
        x = model.embed(token)
        x = x + block.attn.wo(block.attn.wv(block.attn_norm(x)))
        h = block.mlp_norm(x)
        x = x + block.w2(torch.nn.functional.silu(block.w1(h)) * block.w3(h))
        expected = model.head(model.norm(x))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("window", [0, 17])
def test_window_outside_the_cache_is_refused_naming_both(window: int) -> None:
    with pytest.raises(ValueError, match=f"window {window} must be between 1 and max_seq 16"):
        DecoderConfig(max_seq=16, window=window)


def test_config_for_cache_bytes_clips_the_window_to_the_cache() -> None:
    cfg = DecoderConfig.for_cache_bytes(64 * 1024, window=64)  # 16 slots of 8 heads x 64 fp32, K and V
    assert (cfg.max_seq, cfg.window) == (16, 16)


def test_windowed_prefill_of_several_tokens_equals_decoding_them_one_by_one() -> None:
    """Each query of a prefill sees only its own last ``window`` positions, as in decoding."""
    cfg = DecoderConfig(max_seq=16, window=2)
    model = CallerCacheDecoder(cfg, seed=3).eval()
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        caches = [torch.zeros(cfg.cache_shape) for _ in range(2)]
        prefill = model(tokens, torch.arange(5), *caches)
        caches = [torch.zeros(cfg.cache_shape) for _ in range(2)]
        one_by_one = torch.cat([model(tokens[:, i : i + 1], torch.tensor([i]), *caches) for i in range(5)], dim=1)
    torch.testing.assert_close(prefill, one_by_one)
