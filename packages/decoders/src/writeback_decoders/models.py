"""The models writeback-decoders offers, by name, tiny or sized to a K+V cache in MiB."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from writeback_core.types import ModelCase

from writeback_decoders.et_hybrid import et_lfm2_case, et_qwen35_case
from writeback_decoders.et_llama import et_llama_case
from writeback_decoders.hf import HF_ARCHITECTURES, hf_available, hf_model_case, require_transformers

__all__ = ["decoder_models", "sized_case", "sizers"]


def sizers(with_hf: bool | None = None) -> dict[str, Callable[[float | None], ModelCase]]:
    """Each offered name with the function that builds its case for a K+V cache of so many MiB
    (``None``: the tiny default). The Hugging Face models are offered only where transformers
    is installed (``with_hf=None``: checked, without importing it)."""
    found: dict[str, Callable[[float | None], ModelCase]] = {
        "et-llama": et_llama_case,
        "et-lfm2": et_lfm2_case,
        "et-qwen3.5": et_qwen35_case,
    }
    if hf_available() if with_hf is None else with_hf:
        for arch in HF_ARCHITECTURES:
            found[f"hf-{arch}"] = _hf_sizer(arch)
    return found


def _hf_sizer(architecture: str) -> Callable[[float | None], ModelCase]:
    def make(cache_mib: float | None) -> ModelCase:
        return hf_model_case(architecture, cache_mib)

    return make


def decoder_models() -> dict[str, ModelCase]:
    """The tiny defaults, keyed by name: ``et-llama``, ``et-lfm2`` and ``et-qwen3.5`` always,
    ``hf-llama``, ``hf-qwen3`` and ``hf-gemma`` where transformers is installed. Building a case
    imports nothing heavy."""
    return {name: replace(make(None), sized=make) for name, make in sizers().items()}


def sized_case(name: str, cache_mib: float) -> ModelCase:
    """The model ``name`` with a K+V cache of ``cache_mib`` MiB (layers fixed, positions
    chosen to reach the size, rounded down).

    :raises ValueError: ``name`` is not one of these models (the message lists them).
    :raises TransformersMissingError: an ``hf-`` name without transformers installed.
    """
    known = sizers(with_hf=True)
    if name not in known:
        raise ValueError(f"no sized model {name!r}; writeback-decoders sizes: {', '.join(sorted(known))}")
    if name.startswith("hf-"):
        require_transformers(name)
    return known[name](cache_mib)
