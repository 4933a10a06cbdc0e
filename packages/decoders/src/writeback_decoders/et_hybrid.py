"""ExecuTorch's own hybrid examples (shipped in the executorch wheel) as writeback models, built
through the same ``construct_transformer`` as ``et-llama`` (:mod:`writeback_decoders.et_llama`)
with ``ModelArgs.layer_types``:

- ``et-lfm2``: LFM2, a short-convolution layer (``examples/models/lfm2/short_conv.py``,
  ``ShortConv.conv_state`` ``[1, dim, 2]``, rewritten whole every call with the last two columns
  of ``cat([conv_state, Bx])``) then an attention layer.
- ``et-qwen3.5``: Qwen3.5, a gated DeltaNet layer (``gated_deltanet`` in
  ``examples/models/llama/attention.py``: ``conv_state`` as above and ``recurrent_state``
  ``[1, heads, k_dim, v_dim]``, both zeroed by ``mul_`` at position 0, the recurrent state
  rewritten by ExecuTorch's fused ``llama::gated_delta_rule`` op) then a q-gated attention layer
  with QK norm and partial rotary embedding.

Their contender ``et-custom-ops`` is, as for ``et-llama``, ExecuTorch's export of the same model
with its custom KV cache and SDPA ops (the stock lowering of the wheel's XNNPACK configs,
``use_sdpa_with_kv_cache``).
"""

from __future__ import annotations

from writeback_core.types import ModelCase

from writeback_decoders.et_llama import ETLlamaConfig, et_llama_case

__all__ = ["ET_LFM2", "ET_QWEN35", "et_lfm2_case", "et_qwen35_case"]

#: The tiny LFM2: one short-convolution layer, then one attention layer.
ET_LFM2 = ETLlamaConfig(
    name="et-lfm2",
    title="ExecuTorch's LFM2 example",
    layer_types=("conv", "full_attention"),
)

#: The tiny Qwen3.5: one gated DeltaNet layer (2 key heads, 4 value heads of 16), then one
#: q-gated attention layer with QK norm and a quarter of each head rotated.
ET_QWEN35 = ETLlamaConfig(
    name="et-qwen3.5",
    title="ExecuTorch's Qwen3.5 example",
    layer_types=("linear_attention", "full_attention"),
    extra_args=(
        ("use_q_gate", True),
        ("use_qk_norm", True),
        ("partial_rotary_factor", 0.25),
        ("linear_conv_kernel_dim", 4),
        ("linear_key_head_dim", 16),
        ("linear_value_head_dim", 16),
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 4),
    ),
)


def et_lfm2_case(cache_mib: float | None = None) -> ModelCase:
    """ExecuTorch's LFM2 example (:data:`ET_LFM2`; ``cache_mib``: its attention layers' K+V
    caches sized to so many MiB, see :meth:`ETLlamaConfig.sized`), called as ``et-llama`` is."""
    return et_llama_case(cache_mib, ET_LFM2)


def et_qwen35_case(cache_mib: float | None = None) -> ModelCase:
    """ExecuTorch's Qwen3.5 example (:data:`ET_QWEN35`), called as ``et-llama`` is."""
    return et_llama_case(cache_mib, ET_QWEN35)
