"""A Hugging Face causal LM run with ExecuTorch's ``llama::update_cache``/``llama::custom_sdpa``
(:class:`~writeback_decoders.custom_ops.CustomOpsDecoder`) generates transformers' own greedy
tokens (``generate`` with a static cache, an independent implementation), prompt in one call;
configs whose attention those kernels do not compute are refused by name; positions past the
cache are refused with the cache unchanged; lowered through writeback for XNNPACK it keeps
every cache in place and answers as eager in the stock runtime."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from writeback_decoders.custom_ops import CustomOpsDecoder, CustomOpsUnsupported, custom_ops_refusal

transformers = pytest.importorskip("transformers")

PROMPT = [0, 5, 9, 17, 23, 4, 8]
NEW = 12
CACHE = 48


def _llama() -> Any:
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )


def _qwen2() -> Any:
    # Qwen2: attention with biases, grouped queries (4 query heads per key head), no window used.
    return transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_sliding_window=False,
    )


def _model(config: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _reference(model: Any) -> list[int]:
    out = model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=NEW,
        do_sample=False,
        cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": CACHE},
    )
    tokens: list[int] = out[0, len(PROMPT) :].tolist()
    return tokens


def _greedy(decoder: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        logits = decoder(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))  # the prompt in one call
        tokens = [int(logits[0, -1].argmax())]
        for position in range(len(PROMPT), len(PROMPT) + NEW - 1):
            logits = decoder(torch.tensor([[tokens[-1]]]), torch.tensor([position]))
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama", "qwen2"])
def test_custom_ops_decoder_generates_transformers_static_cache_greedy_tokens(make: Any) -> None:
    config = make()
    expected = _reference(_model(config))
    decoder = CustomOpsDecoder(_model(config), CACHE)
    assert _greedy(decoder) == expected
    # Written rows: the prompt and every decoded token but the last; nothing past them.
    written = len(PROMPT) + NEW - 1
    keys = decoder.get_buffer("key_cache_0")
    assert keys.shape == (1, CACHE, config.num_key_value_heads, 64 // config.num_attention_heads)
    assert bool(keys[:, :written].abs().sum(-1).gt(0).all())
    assert bool(keys[:, written:].eq(0).all())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"sliding_window": 16, "use_sliding_window": True}, "a sliding window of 16 positions"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layers of type ['sliding_attention']"),
        ({"attn_logit_softcapping": 30.0}, "attention logit soft-capping"),
        ({"is_encoder_decoder": True}, "an encoder-decoder model"),
    ],
    ids=["sliding-window", "sliding-layers", "softcapping", "encoder-decoder"],
)
def test_attention_the_kernels_do_not_compute_is_refused_by_name(change: dict[str, Any], named: str) -> None:
    config = _qwen2()
    for key, value in change.items():
        setattr(config, key, value)
    assert named in (custom_ops_refusal(config) or "")
    with pytest.raises(CustomOpsUnsupported, match=f"uses {re.escape(named)}.*static-cache attention instead"):
        CustomOpsDecoder(_Configured(config), CACHE)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"s_aux": torch.zeros(4)}, "arguments ['s_aux']"), ({"dropout": 0.1}, "dropout")],
    ids=["attention-sinks", "dropout"],
)
def test_attention_asked_for_what_custom_sdpa_does_not_compute_is_refused_by_name(
    kwargs: dict[str, Any], named: str
) -> None:
    from writeback_decoders.custom_ops import _attention

    q = torch.zeros(1, 4, 1, 16)
    cache = torch.zeros(1, 8, 2, 16)
    with pytest.raises(CustomOpsUnsupported, match=re.escape(named)):
        _attention(torch.nn.Module(), q, cache, cache, None, **kwargs)


def test_hf_case_refuses_custom_ops_for_a_windowed_config_naming_the_window() -> None:
    from writeback_decoders.hf import hf_case

    config = _qwen2()
    config.sliding_window, config.use_sliding_window = 8, True
    with pytest.raises(CustomOpsUnsupported, match=r"sliding window of 8 positions.*attention='static'"):
        hf_case(config, attention="custom-ops")


class _Configured:
    """Only a config: the decoder must refuse before touching the model."""

    def __init__(self, config: Any) -> None:
        self.config = config


def test_positions_past_the_cache_are_refused_and_the_cache_is_unchanged() -> None:
    decoder = CustomOpsDecoder(_model(_llama()), 8)
    with torch.no_grad():
        decoder(torch.tensor([[1, 2, 3]]), torch.arange(3))
        before = {n: b.clone() for n, b in decoder.named_buffers()}
        with pytest.raises(IndexError, match=r"positions \[6, 9\) do not fit the cache of 8 positions"):
            decoder(torch.tensor([[4, 5, 6]]), torch.tensor([6, 7, 8]))
    for name, value in decoder.named_buffers():
        assert torch.equal(value, before[name]), name


@pytest.mark.slow  # a lowering
def test_lowered_for_xnnpack_every_cache_stays_in_place_and_answers_as_eager() -> None:
    from executorch.runtime import Runtime
    from writeback_core import load_registry
    from writeback_core.exporting import export_model
    from writeback_core.lowering import lower
    from writeback_passes import plugin as passes_plugin

    model = _model(_qwen2())
    decoder = CustomOpsDecoder(model, CACHE).eval().requires_grad_(False)
    eager = copy.deepcopy(decoder)
    tokens = torch.export.Dim("tokens", min=1, max=CACHE)
    example = {"input_ids": torch.tensor([[1, 2]]), "cache_position": torch.arange(2)}
    shapes = {"input_ids": {1: tokens}, "cache_position": {0: tokens}}
    exported = export_model(decoder, (), example, strict=False, dynamic_shapes=shapes)
    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    lowered = lower(exported, registry, registry.backends()["xnnpack"], "planned")
    assert lowered.write_back_bytes == {}  # no cache copied back whole
    plan = lowered.program.executorch_program.execution_plan[0]
    names = {op.name for op in plan.operators}
    assert {"llama::update_cache", "llama::custom_sdpa"} <= names
    program = Runtime.get().load_program(lowered.pte)
    method = program.load_method("forward")
    start = 0
    with torch.no_grad():
        for ids in ([3, 1, 4, 1, 5, 9, 2], [6], [5], [3, 5]):
            got = method.execute([torch.tensor([ids]), torch.arange(start, start + len(ids))])[0]
            expected = eager(torch.tensor([ids]), torch.arange(start, start + len(ids)))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            start += len(ids)
    torch.testing.assert_close(
        method._method.get_attribute("key_cache_1"), eager.get_buffer("key_cache_1"), rtol=1e-4, atol=1e-4
    )
    del method, program
