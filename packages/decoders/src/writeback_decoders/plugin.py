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
def writeback_model_from_path(path: str, accept_weights: bool) -> ModelCase | None:
    """A local Hugging Face folder (``config.json``, whatever kind of file it is): checked
    as data first (:func:`~writeback_decoders.folder_checks.check_folder`: the config, the
    model's size against memory, the weights against the architecture), then its attention
    through ExecuTorch's ``llama::update_cache``/``llama::custom_sdpa`` where they compute it
    (reads only the written positions), else transformers' static cache; a model with
    convolution, SSM or linear-attention layers with every state of its cache layers as
    program buffers (:mod:`writeback_decoders.hf_states`), or refused (``StatesUnsupported``,
    a ``ValueError``)."""
    import os
    from pathlib import Path

    if not os.path.lexists(Path(path) / "config.json"):
        return None
    from writeback_decoders.folder_checks import accepted_note, check_folder

    accepted = check_folder(path, accept_weights)
    from writeback_decoders.custom_ops import custom_ops_refusal
    from writeback_decoders.hf import config_of, hf_case
    from writeback_decoders.hf_states import uses_states

    config = config_of(path)
    if uses_states(config):
        case = hf_case(path, attention="states")
    else:
        supported = custom_ops_refusal(config) is None
        case = hf_case(path, attention="custom-ops" if supported else "static")
    return accepted_note(case, accepted) if accepted else case
