"""Entry-point plugin of writeback-decoders: offers the real decoders through ``writeback_models``
(thin: transformers and ExecuTorch's Llama example are imported only when a model is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from writeback_core import hookimpl

if TYPE_CHECKING:
    from writeback_core.types import ModelCase

writeback_name = "decoders"


@hookimpl
def writeback_models() -> dict[str, ModelCase]:
    from writeback_decoders.models import decoder_models

    return decoder_models()


@hookimpl
def writeback_model_from_path(path: str) -> ModelCase | None:
    """A local Hugging Face folder (``config.json``): its attention through ExecuTorch's
    ``llama::update_cache``/``llama::custom_sdpa`` where they compute it (reads only the
    written positions), else transformers' static cache; a model with convolution, SSM or
    linear-attention layers with every state of its cache layers as program buffers
    (:mod:`writeback_decoders.hf_states`), or refused (``StatesUnsupported``, a ``ValueError``)."""
    from pathlib import Path

    if not (Path(path) / "config.json").is_file():
        return None
    from writeback_decoders.custom_ops import custom_ops_refusal
    from writeback_decoders.hf import config_of, hf_case
    from writeback_decoders.hf_states import uses_states

    config = config_of(path)
    if uses_states(config):
        return hf_case(path, attention="states")
    supported = custom_ops_refusal(config) is None
    return hf_case(path, attention="custom-ops" if supported else "static")
