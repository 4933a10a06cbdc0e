"""writeback-decoders: real decoder architectures as writeback models.

- ``et_llama``: ExecuTorch's Llama example with its KV cache (:func:`et_llama_case`,
  :class:`ETLlamaConfig`), with ExecuTorch's custom-op export as the
  ``et-custom-ops`` contender.
- ``et_hybrid``: ExecuTorch's LFM2 and Qwen3.5 examples built the same way
  (:func:`et_lfm2_case`, :func:`et_qwen35_case`).
- ``hf``: Hugging Face causal LMs with a ``StaticCache``, exported as transformers'
  ExecuTorch integration does (:func:`hf_case` for a local folder or a config,
  :func:`hf_model_case` for the named defaults; needs the ``hf`` extra).
- ``logits``: which positions' logits a Hugging Face decoder returns (the last by default,
  what ExecuTorch's LLM runner reads; every position's when a case's ``all_logits`` asks).
- ``folder_checks``: a local model folder checked as data before a model is built
  (:func:`check_folder`, refusing with :class:`FolderRefused`): config, size against
  memory, safetensors headers, weights against the architecture.
- ``models``: what the plugin offers (:func:`decoder_models`) and each model at a
  K+V cache size in MiB (:func:`sized_case`).
- ``steps``: :class:`GreedyTokens`, the decode steps greedy decoding makes.
"""

from __future__ import annotations

from writeback_decoders.et_hybrid import ET_LFM2, ET_QWEN35, et_lfm2_case, et_qwen35_case
from writeback_decoders.et_llama import ETLlamaConfig, et_llama_case
from writeback_decoders.folder_checks import FolderRefused, check_folder
from writeback_decoders.hf import (
    HF_ARCHITECTURES,
    HFArchitecture,
    TransformersMissingError,
    hf_available,
    hf_case,
    hf_config,
    hf_model_case,
    require_transformers,
)
from writeback_decoders.models import decoder_models, sized_case, sizers
from writeback_decoders.steps import GreedyTokens, cache_positions

__all__ = [
    "ET_LFM2",
    "ET_QWEN35",
    "HF_ARCHITECTURES",
    "ETLlamaConfig",
    "FolderRefused",
    "GreedyTokens",
    "HFArchitecture",
    "TransformersMissingError",
    "cache_positions",
    "check_folder",
    "decoder_models",
    "et_lfm2_case",
    "et_llama_case",
    "et_qwen35_case",
    "hf_available",
    "hf_case",
    "hf_config",
    "hf_model_case",
    "require_transformers",
    "sized_case",
    "sizers",
]
