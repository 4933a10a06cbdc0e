"""The static-cache module a Hugging Face folder is exported as, in eager (fast tier): it follows
transformers' own ExecuTorch integration, where a call's first position sets where every layer
writes, so a new generation from position 0 overwrites the cache instead of going on after it."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("all_logits", [False, True])
def test_a_second_generation_from_position_0_gives_a_fresh_models_logits_not_a_continued_one(
    all_logits: bool,
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from writeback_decoders.hf import _wrap

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    first, second = torch.tensor([[5, 9, 3, 7]]), torch.tensor([[11, 2, 8]])
    with torch.no_grad():
        wrapped = _wrap(model, 16, all_logits)
        wrapped(input_ids=first, cache_position=torch.arange(4))
        got = wrapped(input_ids=second, cache_position=torch.arange(3))
        fresh = model(second).logits
    expected = fresh if all_logits else fresh[:, -1:]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_cache_layer_without_a_write_position_tensor_is_refused_naming_the_layer_and_nothing_written() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from writeback_decoders.hf import _wrap

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    wrapped = _wrap(LlamaForCausalLM(config).eval(), 16)
    layers = wrapped.static_cache.layers
    wrapped(input_ids=torch.tensor([[3]]), cache_position=torch.tensor([4]))  # layer 0's counter now 4
    layers[1].cumulative_length = 0  # an int, as a layer type without the counter would hold
    counter = layers[0].cumulative_length.clone()
    before = [layer.keys.clone() if layer.keys is not None else None for layer in layers]
    with pytest.raises(TypeError, match=r"static cache layer 1 \(\w+\) keeps no cumulative_length tensor"):
        with torch.no_grad():
            wrapped(input_ids=torch.tensor([[5, 9]]), cache_position=torch.arange(2))
    assert torch.equal(layers[0].cumulative_length, counter)
    after = [layer.keys for layer in layers]
    for old, new in zip(before, after, strict=True):
        assert (old is None and new is None) or torch.equal(old, new)
