"""A Hugging Face causal LM whose attention reads only the positions written so far.

transformers' ``StaticCache`` writes a call's keys and values with ``index_copy_`` into a
``[batch, heads, max_cache_len, head_dim]`` cache and its attention then reads the whole
cache, masked: at position 10 of a 1,024-position cache every step reads 1,024 rows. ExecuTorch's
LLM runner links two kernels that avoid that (``llama::update_cache`` writes ``n`` rows at
``start_pos`` in place; ``llama::custom_sdpa`` attends causally over rows ``[0, start_pos + n)``),
both over a ``[batch, max_cache_len, heads, head_dim]`` cache. :class:`CustomOpsDecoder` runs the
model with those two: its cache layers keep that layout and write with ``update_cache``, and
an attention function registered with transformers calls ``custom_sdpa``. The cache is written
in place by the kernel itself (no functional write, no write-back), and each call reads only
what is written.

Only what those kernels compute is accepted: causal self-attention with no sliding window,
no logit soft-capping, no attention sinks; :func:`custom_ops_refusal` names what a config
uses that they do not. Every answer is checked against transformers' own static-cache
generation in the tests.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from writeback_decoders.logits import causal_lm_logits, keeps_logits

__all__ = [
    "ATTENTION_NAME",
    "CustomOpsDecoder",
    "CustomOpsUnsupported",
    "custom_ops_refusal",
    "load_custom_ops",
]

# The name the attention function is registered under with transformers.
ATTENTION_NAME = "writeback_custom_sdpa"

# The first cache position of the call being run (an int eagerly, a SymInt while exporting).
_START: contextvars.ContextVar[Any] = contextvars.ContextVar("writeback_custom_ops_start")

# Keyword arguments transformers passes to an attention function that these kernels honour
# as long as they hold these values (None: absent).
_IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "is_causal"})


class CustomOpsUnsupported(ValueError):
    """The model's attention computes something ExecuTorch's ``custom_sdpa`` does not."""


def load_custom_ops() -> None:
    """Register ExecuTorch's ``llama::update_cache`` and ``llama::custom_sdpa`` with torch (their
    eager kernels and export meta functions ship in the executorch wheel)."""
    import importlib

    if not hasattr(torch.ops.llama, "custom_sdpa"):
        importlib.import_module("executorch.extension.llm.custom_ops.custom_ops")


def custom_ops_refusal(config: Any) -> str | None:
    """Why a model with ``config`` cannot run its attention with ``custom_sdpa``, or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        kinds = sorted({t for t in layer_types if t != "full_attention"})
        return f"layers of type {kinds} (custom_sdpa attends over every written position: full attention only)"
    window = getattr(text, "sliding_window", None)
    if window is not None and getattr(text, "use_sliding_window", True):
        return f"a sliding window of {window} positions (custom_sdpa has none)"
    for field in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(text, field, None) is not None:
            return f"attention logit soft-capping ({field}={getattr(text, field)}; custom_sdpa has none)"
    if getattr(text, "is_encoder_decoder", False):
        return "an encoder-decoder model (custom_sdpa is causal self-attention)"
    return None


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract over a ``[B, S, H, D]`` cache: ``query``
    ``[B, Hq, n, D]`` in, ``[B, n, Hq, D]`` out, causal over rows ``[0, start + n)``."""
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _IGNORED_KWARGS)
    if unknown or dropout or not getattr(module, "is_causal", True):
        what = f"arguments {unknown}" if unknown else ("dropout" if dropout else "non-causal attention")
        raise CustomOpsUnsupported(
            f"{type(module).__name__} asks the attention for {what}, which llama::custom_sdpa does not compute; "
            "export this model with the static-cache attention instead"
        )
    start = _START.get()
    out = torch.ops.llama.custom_sdpa(query.transpose(1, 2), key, value, start, None, 0.0, True, scaling)
    return out, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


class _Layer:
    """One layer's cache in ``[B, S, H, D]``, written by ``llama::update_cache`` at the call's start."""

    is_compileable = True
    is_sliding = False
    is_initialized = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.max_cache_len = keys.shape[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        start = _START.get()
        torch.ops.llama.update_cache(key_states.transpose(1, 2).contiguous(), self.keys, start)
        torch.ops.llama.update_cache(value_states.transpose(1, 2).contiguous(), self.values, start)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        raise CustomOpsUnsupported("CustomOpsDecoder passes positions explicitly; the cache keeps no length")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0


@contextmanager
def _started_at(start: Any) -> Iterator[None]:
    token = _START.set(start)
    try:
        yield
    finally:
        _START.reset(token)


class CustomOpsDecoder(nn.Module):
    """``model`` (a transformers causal LM) as ExecuTorch's runner calls it, ``forward(input_ids
    [1, n], cache_position [n]) -> logits [1, 1, V]`` (the last position's; every position's,
    ``[1, n, V]``, with ``all_logits``: :mod:`writeback_decoders.logits`), its caches written by
    ``llama::update_cache`` and read by ``llama::custom_sdpa`` up to the last written position.

    Cache buffers ``key_cache_{i}``/``value_cache_{i}`` are ``[1, max_cache_len, kv_heads,
    head_dim]``. Positions are ``cache_position[0] + arange(n)`` (a prompt of ``n`` tokens at
    ``start``, as the runner passes them); the call is refused when they pass the cache.

    :raises CustomOpsUnsupported: the config uses attention these kernels do not compute.
    """

    def __init__(self, model: Any, max_cache_len: int, all_logits: bool = False) -> None:
        super().__init__()
        from transformers import StaticCache
        from transformers.integrations.executorch import get_head_shapes  # type: ignore[attr-defined]  # not in its __all__

        refusal = custom_ops_refusal(model.config)
        if refusal is not None:
            raise CustomOpsUnsupported(
                f"{type(model).__name__} uses {refusal}; export it with the static-cache attention instead"
            )
        load_custom_ops()
        _register()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTENTION_NAME)
        else:  # pragma: no cover - older transformers
            model.config._attn_implementation = ATTENTION_NAME
        model.config.use_cache = True
        self.model = model
        self.max_cache_len = max_cache_len
        self.all_logits = all_logits
        self._keeps = keeps_logits(model)
        text = model.config.get_text_config()
        heads, head_dim = get_head_shapes(text)
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        dtype = next(model.parameters()).dtype
        layers: list[_Layer] = []
        for i in range(len(self.cache.layers)):
            h = heads[i] if isinstance(heads, list) else heads  # per layer where layers differ
            d = head_dim[i] if isinstance(head_dim, list) else head_dim
            keys = torch.zeros(1, max_cache_len, h, d, dtype=dtype)
            values = torch.zeros(1, max_cache_len, h, d, dtype=dtype)
            self.register_buffer(f"key_cache_{i}", keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", values, persistent=False)
            layers.append(_Layer(keys, values))
        self.cache.layers = layers  # type: ignore[assignment]  # duck-typed cache layers
        self._layers = layers

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        start = cache_position[0].item()
        n = input_ids.shape[1]
        if isinstance(start, int) and not 0 <= start <= self.max_cache_len - n:  # eager: say which
            raise IndexError(
                f"positions [{start}, {start + n}) do not fit the cache of {self.max_cache_len} positions; "
                "start a new generation or export with a longer cache"
            )
        torch._check(start >= 0)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        torch._check(start + n <= self.max_cache_len)  # type: ignore[no-untyped-call]  # unannotated in torch
        position_ids = (torch.arange(n) + start).unsqueeze(0)
        # The layers write the buffers as this call sees them (torch.export traces the module's
        # attributes, not tensors held elsewhere).
        for i, layer in enumerate(self._layers):
            layer.keys, layer.values = getattr(self, f"key_cache_{i}"), getattr(self, f"value_cache_{i}")
        with _started_at(start):
            return causal_lm_logits(
                self.model,
                self.all_logits,
                self._keeps,
                input_ids=input_ids,
                attention_mask=None,
                position_ids=position_ids,
                past_key_values=self.cache,
                use_cache=True,
            )
