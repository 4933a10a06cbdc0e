"""Falcon-H1 through transformers 5.23's ExecuTorch wrapper (``TorchExportableModuleWithStaticCache``)
loses its state in ``torch.export``: its cache layers (``LinearAttentionAndStaticFullAttentionLayer``)
skip the wrapper's ``early_initialization``, so the wrapper registers ``None`` for each key and value
cache, and the keys, values, conv and SSM states are allocated inside the traced call: temporaries of
the program, zeros every call; only the two ``cumulative_length`` counters stay state. Every command
and the API refuse it, naming those states (slow tier: transformers). A Falcon-H1 folder itself is
now built with every state of its cache layers as a program buffer (tests/decoders/test_hf_states.py);
the commands' refusal of a model that drops state is tested on a hand-written model with the same
mechanism (tests/e2e/test_state_lost.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

# What a layer of the tiny config keeps per call (batch 1): keys and values [1, kv heads 2,
# positions 32, head dim 16]; the conv state [1, d_ssm 64 + 2 x groups 1 x d_state 8, kernel 4];
# the SSM state [1, mamba heads 4, head dim 16, d_state 8].
LOST = [
    f"static_cache.layers[{layer}].{name}"
    for layer in range(2)
    for name in ("keys", "values", "conv_states[0]", "recurrent_states[0]")
]


def _config(vocab: int = 69) -> Any:
    from transformers import FalconH1Config

    return FalconH1Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=8,
        bos_token_id=0,
        eos_token_id=1,
    )


def test_export_model_of_transformers_wrapper_raises_state_lost_naming_every_state_clear_error() -> None:
    from transformers import FalconH1ForCausalLM, GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache
    from writeback_core.carried_state import StateLostError
    from writeback_core.exporting import export_model

    torch.manual_seed(0)
    model = FalconH1ForCausalLM(_config()).eval()
    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static", cache_config={"batch_size": 1, "max_cache_len": 32}
    )
    wrapper = TorchExportableModuleWithStaticCache(model)
    inputs = {"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])}
    with pytest.raises(StateLostError) as raised:
        export_model(wrapper, (), inputs, strict=True, name="model 'falcon'")
    assert sorted(s.path for s in raised.value.states) == sorted(LOST)
    assert all(s.buffers == () for s in raised.value.states)
    assert raised.value.kept == ["cumulative_length_0", "cumulative_length_1"]
    assert [layer.keys for layer in wrapper.static_cache.layers] == [None, None]  # the caller's wrapper untouched
