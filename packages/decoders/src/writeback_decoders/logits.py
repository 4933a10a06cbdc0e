"""Which positions' logits a Hugging Face decoder's program returns.

ExecuTorch's LLM runner reads one row of the logits a call returns, the last: its
``TextDecoderRunner::logits_to_token`` takes row ``n - 1`` of ``[1, n, V]`` and a ``[1, V]`` as
it is. A prefill of ``n`` tokens that returns every row runs the LM head on ``n - 1`` rows
nobody reads, and its program plans a ``[1, max_seq_len, V]`` buffer for them (at Qwen2.5-0.5B's
vocabulary of 151,936 and 1,024 tokens, 594 MiB).

So the decoders of this package keep the last position only by default: the hidden state is
cut to its last row before the LM head (transformers' ``logits_to_keep=1``), and a call returns
``[1, 1, V]``. The rank stays 3, so the runner, ``writeback generate`` and any caller reading
``logits[0, -1]`` read the same row as from ``[1, n, V]``. A model or tool that scores every
position asks for every row (``all_logits``, ``writeback export --all-logits``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["ALL_LOGITS_NOTE", "causal_lm_logits", "keeps_logits"]

#: What a case returning every position's logits adds to its description.
ALL_LOGITS_NOTE = "logits of every position returned (the LM head runs on every position)"


def keeps_logits(model: nn.Module) -> bool:
    """Whether ``model.forward`` (a transformers causal LM) takes ``logits_to_keep``, so that it
    runs its LM head on the kept rows only."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def causal_lm_logits(model: nn.Module, all_logits: bool, keeps: bool, **inputs: Any) -> torch.Tensor:
    """``model(**inputs).logits``: every position's (``all_logits``), else the last one's,
    ``[1, 1, V]``.

    :param keeps: :func:`keeps_logits` of ``model`` (worked out once, outside the traced call):
        the last row is then cut before the LM head; a model that does not take
        ``logits_to_keep`` computes every row, and the last is cut after it.
    """
    if all_logits:
        logits: torch.Tensor = model(**inputs).logits
        return logits
    if keeps:
        kept: torch.Tensor = model(**inputs, logits_to_keep=1).logits
        return kept
    every: torch.Tensor = model(**inputs).logits
    return every[:, -1:, :]
