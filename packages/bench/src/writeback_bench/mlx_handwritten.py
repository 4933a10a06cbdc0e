"""Decoders written by hand in MLX, as mlx-lm writes its models: the anchor of
``python -m writeback_bench.mlx --vs-mlx``.

Each class takes a torch module that writeback lowers and copies its weights to
MLX once; ``step(token, position)`` then runs one decode step of the same model
in MLX, with no torch on the way:

- every projection weight is transposed once at load and made contiguous, so a
  step's matmuls are ``x @ W_t``;
- the fused kernels ``mx.fast.rms_norm``, ``mx.fast.rope`` (given the torch
  model's own inverse frequencies, so the angles match it to fp32 rounding at
  every position) and ``mx.fast.scaled_dot_product_attention`` (grouped-query
  attention without tiling K and V);
- each layer's K and V cache is an MLX array the model owns, written at the
  step's position by slice assignment; the old array is referenced by nothing
  else, so MLX donates its buffer and the write is in place;
- one ``mx.eval`` per step, of the logits and the new caches together.

Attention reads the cache as mlx-lm does: ``attend="filled"`` (the default)
slices the cache to the positions the torch model can see at this step, so it
needs no mask; ``attend="masked"`` reads every slot with the boolean mask the
torch model builds. Both compute the same logits as the torch model (a masked
slot gets weight exactly 0); ``"masked"`` does the same amount of work as a
graph with static shapes, ``"filled"`` as little as a hand-written decoder does.

The models decode one token per step; the position wraps the cache as the torch
models do (``writeback.zoo`` feeds position ``step % max_seq``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    import mlx.core as mx
    from torch import nn

__all__ = ["Attend", "HandwrittenDecoder", "HandwrittenETLlama"]

Attend = Literal["filled", "masked"]


def _array(tensor: torch.Tensor) -> mx.array:
    """A contiguous fp32 MLX copy of ``tensor``."""
    import mlx.core as mx

    return mx.array(tensor.detach().to(torch.float32).contiguous().numpy())


def _transposed(linear: nn.Module) -> mx.array:
    """``linear.weight`` (``[out, in]``) laid out once as a contiguous ``[in, out]`` array."""
    import mlx.core as mx

    weight = linear.weight
    if not isinstance(weight, torch.Tensor) or getattr(linear, "bias", None) is not None:
        raise ValueError(f"expected a bias-free linear layer, got {type(linear).__name__}")
    return mx.contiguous(_array(weight).T)


def _visible(position: int, max_seq: int, window: int | None) -> tuple[int, int]:
    """The slots ``[lo, hi)`` a query at ``position`` attends to (``window``: the last so many)."""
    lo = 0 if window is None else max(0, position - window + 1)
    return lo, position + 1


class _Layers:
    """What both decoders share: the K/V caches they own, the attention over them, the step's eval."""

    def __init__(self, layers: int, kv_heads: int, max_seq: int, head_dim: int, attend: Attend) -> None:
        import mlx.core as mx

        if attend not in ("filled", "masked"):
            raise ValueError(f"attend must be 'filled' or 'masked', got {attend!r}")
        self.attend: Attend = attend
        self.max_seq = max_seq
        shape = (1, kv_heads, max_seq, head_dim)
        self.keys = [mx.zeros(shape) for _ in range(layers)]
        self.values = [mx.zeros(shape) for _ in range(layers)]
        mx.eval(self.keys, self.values)

    def check_position(self, position: int) -> None:
        if not 0 <= position < self.max_seq:
            raise ValueError(f"position {position} is outside the cache (max_seq {self.max_seq})")

    def attention(
        self, layer: int, q: mx.array, k: mx.array, v: mx.array, position: int, window: int | None, scale: float
    ) -> mx.array:
        """Write ``k`` and ``v`` (``[1, kv_heads, 1, head_dim]``) at ``position`` in place and
        attend ``q`` (``[1, heads, 1, head_dim]``) over the slots the model sees."""
        import mlx.core as mx

        # Slice assignment on the array this object alone holds: MLX donates its buffer.
        self.keys[layer][:, :, position : position + 1, :] = k
        self.values[layer][:, :, position : position + 1, :] = v
        keys, values = self.keys[layer], self.values[layer]
        lo, hi = _visible(position, self.max_seq, window)
        if self.attend == "filled":
            return mx.fast.scaled_dot_product_attention(
                q, keys[:, :, lo:hi, :], values[:, :, lo:hi, :], scale=scale, mask=None
            )
        slots = mx.arange(self.max_seq)
        mask = (slots >= lo) & (slots < hi)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)

    def evaluate(self, logits: mx.array) -> mx.array:
        """The step's one ``mx.eval``: the logits and every new cache together."""
        import mlx.core as mx

        mx.eval(logits, self.keys, self.values)
        return logits


class HandwrittenDecoder:
    """The built-in decoder (:class:`writeback.zoo.TinyDecoder`) written by hand in MLX.

    :param module: the torch decoder whose weights are copied (a ``TinyDecoder`` or
        ``CallerCacheDecoder``, anything else raises ``ValueError``); its caches are
        not read, the MLX caches start at zero.
    :param attend: see the module docstring.

    ``step(token, position)`` returns the logits ``[1, 1, vocab]``, as the torch model does.
    """

    def __init__(self, module: nn.Module, attend: Attend = "filled") -> None:
        from writeback.zoo import CallerCacheDecoder, TinyDecoder

        if not isinstance(module, (TinyDecoder, CallerCacheDecoder)):
            raise ValueError(f"expected writeback's built-in decoder, got {type(module).__name__}")
        model: Any = module  # submodules read as attributes are typed Tensor | Module
        cfg = model.cfg
        self.cfg = cfg
        self.eps = [float(block.attn_norm.eps) for block in model.blocks]
        self.embed = _array(model.embed.weight)
        self.blocks: list[dict[str, mx.array]] = []
        for block in model.blocks:
            attn = block.attn
            self.blocks.append(
                {
                    "attn_norm": _array(block.attn_norm.weight),
                    "mlp_norm": _array(block.mlp_norm.weight),
                    "wq": _transposed(attn.wq),
                    "wk": _transposed(attn.wk),
                    "wv": _transposed(attn.wv),
                    "wo": _transposed(attn.wo),
                    "w1": _transposed(block.w1),
                    "w2": _transposed(block.w2),
                    "w3": _transposed(block.w3),
                }
            )
        self.mlp_eps = [float(block.mlp_norm.eps) for block in model.blocks]
        self.norm = _array(model.norm.weight)
        self.norm_eps = float(model.norm.eps)
        self.head = _transposed(model.head)
        self.cache = _Layers(cfg.layers, cfg.heads, cfg.max_seq, cfg.head_dim, attend)

    def step(self, token: int, position: int) -> mx.array:
        """One decode step: feed ``token`` at cache slot ``position``; one ``mx.eval``."""
        import mlx.core as mx

        self.cache.check_position(position)
        cfg = self.cfg
        heads = (1, 1, cfg.heads, cfg.head_dim)
        x = self.embed[mx.array([[token]])]
        for i, w in enumerate(self.blocks):
            h = mx.fast.rms_norm(x, w["attn_norm"], self.eps[i])
            q = (h @ w["wq"]).reshape(heads).transpose(0, 2, 1, 3)
            k = (h @ w["wk"]).reshape(heads).transpose(0, 2, 1, 3)
            v = (h @ w["wv"]).reshape(heads).transpose(0, 2, 1, 3)
            out = self.cache.attention(i, q, k, v, position, cfg.window, 1.0 / math.sqrt(cfg.head_dim))
            x = x + out.transpose(0, 2, 1, 3).reshape(1, 1, cfg.dim) @ w["wo"]
            h = mx.fast.rms_norm(x, w["mlp_norm"], self.mlp_eps[i])
            x = x + (_silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"]
        logits = mx.fast.rms_norm(x, self.norm, self.norm_eps) @ self.head
        return self.cache.evaluate(logits)


def _silu(x: mx.array) -> mx.array:
    import mlx.core as mx

    return x * mx.sigmoid(x)


# ModelArgs fields whose non-default value changes the forward pass in a way the
# hand-written model does not implement: field -> the value it must have.
_PLAIN_LLAMA: dict[str, Any] = {
    "attention_type": "mha",
    "use_kv_cache": True,
    "enable_dynamic_shape": False,
    "generate_full_logits": False,
    "apply_embedding": True,
    "apply_output": True,
    "use_hf_rope": False,
    "use_scaled_rope": False,
    "partial_rotary_factor": 1.0,
    "no_rope_layer_interval": None,
    "rms_norm_add_unit_offset": False,
    "attention_qkv_bias": False,
    "use_qk_norm": False,
    "use_q_gate": False,
    "use_attn_o_gate": False,
    "use_attn_o_norm": False,
    "scale_query_by": 1.0,
    "moe": False,
    "use_residual_gate": False,
    "use_ffn_learnable_scales": False,
    "target_modules": None,
    "layer_types": None,
    "mlp_type": None,
    "num_kv_shared_layers": 0,
    "sliding_window": None,
    "input_prune_map": None,
    "output_prune_map": None,
    "embedding_scale_factor": 1.0,
    "logits_scaling": None,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "output_soft_cap_temp": None,
    "normalize_tok_embeddings": False,
    "residual_multiplier": None,
    "attention_multiplier": None,
}


def _inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE's inverse frequencies computed by the very expression of ExecuTorch's
    ``precompute_freqs_cis`` (so they are the same fp32 values its tables are built from)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: (head_dim // 2)].float() / head_dim))


class HandwrittenETLlama:
    """ExecuTorch's Llama example (``llama_transformer.construct_transformer``, KV cache on)
    written by hand in MLX.

    The torch model it matches, read from ``executorch.examples.models.llama``:
    RMSNorm ``x * rsqrt(mean(x*x) + norm_eps) * weight``; RoPE on interleaved pairs
    ``(x[2i], x[2i+1])`` with angles ``position * theta^(-2i/head_dim)``
    (``mx.fast.rope(traditional=True)``); the new K and V written at ``input_pos``
    in caches ``[1, n_kv_heads, max_context_len, head_dim]``; attention over the
    causal row ``mask[input_pos]`` with K and V repeated ``n_heads // n_kv_heads``
    times by ``repeat_interleave`` (query head ``h`` reads KV head ``h // n_rep``,
    which is how ``mx.fast.scaled_dot_product_attention`` groups heads), scale
    ``1/sqrt(head_dim)``; SwiGLU ``w2(silu(w1 x) * w3 x)``; the last position's
    logits ``[1, vocab]``.

    :param module: the torch ``Transformer``; its ``params`` must be the plain
        Llama configuration (options such as HF RoPE, QK norm or MoE raise ``ValueError``).
    :param attend: see the module docstring.
    """

    def __init__(self, module: nn.Module, attend: Attend = "filled") -> None:
        import mlx.core as mx

        model: Any = module  # executorch's example is untyped
        params = model.params
        unsupported = {
            name: getattr(params, name)
            for name, plain in _PLAIN_LLAMA.items()
            if hasattr(params, name) and getattr(params, name) != plain
        }
        if unsupported:
            raise ValueError(f"the hand-written Llama implements the plain configuration only; got {unsupported}")
        self.heads = int(params.n_heads)
        self.kv_heads = int(params.n_kv_heads or params.n_heads)
        self.head_dim = int(params.head_dim or params.dim // params.n_heads)
        self.dim = int(params.dim)
        self.eps = float(params.norm_eps)
        max_seq = int(params.max_context_len)
        self.embed = _array(model.tok_embeddings.weight)
        self.layers: list[dict[str, mx.array]] = []
        for layer in model.layers:
            attn, ffn = layer.attention, layer.feed_forward
            self.layers.append(
                {
                    "attention_norm": _array(layer.attention_norm.weight),
                    "ffn_norm": _array(layer.ffn_norm.weight),
                    "wq": _transposed(attn.wq),
                    "wk": _transposed(attn.wk),
                    "wv": _transposed(attn.wv),
                    "wo": _transposed(attn.wo),
                    "w1": _transposed(ffn.w1),
                    "w2": _transposed(ffn.w2),
                    "w3": _transposed(ffn.w3),
                }
            )
        self.norm = _array(model.norm.weight)
        self.output = _transposed(model.output)
        # mx.fast.rope takes wavelengths (angle = position / freqs): the reciprocal
        # of the torch model's own inverse frequencies, not a base MLX would recompute.
        self.rope_freqs = mx.array((1.0 / _inverse_frequencies(self.head_dim, float(params.rope_freq_base))).numpy())
        self.cache = _Layers(len(self.layers), self.kv_heads, max_seq, self.head_dim, attend)

    def step(self, token: int, position: int) -> mx.array:
        """One decode step: feed ``token`` at cache slot ``position``; one ``mx.eval``."""
        import mlx.core as mx

        self.cache.check_position(position)
        hd = self.head_dim
        x = self.embed[mx.array([[token]])]
        scale = 1.0 / math.sqrt(hd)
        for i, w in enumerate(self.layers):
            h = mx.fast.rms_norm(x, w["attention_norm"], self.eps)
            q = (h @ w["wq"]).reshape(1, 1, self.heads, hd).transpose(0, 2, 1, 3)
            k = (h @ w["wk"]).reshape(1, 1, self.kv_heads, hd).transpose(0, 2, 1, 3)
            v = (h @ w["wv"]).reshape(1, 1, self.kv_heads, hd).transpose(0, 2, 1, 3)
            q = self._rope(q, position)
            k = self._rope(k, position)
            out = self.cache.attention(i, q, k, v, position, None, scale)
            x = x + out.transpose(0, 2, 1, 3).reshape(1, 1, self.heads * hd) @ w["wo"]
            h = mx.fast.rms_norm(x, w["ffn_norm"], self.eps)
            x = x + (_silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"]
        logits = mx.fast.rms_norm(x[:, -1, :], self.norm, self.eps) @ self.output
        return self.cache.evaluate(logits)

    def _rope(self, x: mx.array, position: int) -> mx.array:
        import mlx.core as mx

        return mx.fast.rope(
            x, self.head_dim, traditional=True, base=None, scale=1.0, offset=position, freqs=self.rope_freqs
        )
