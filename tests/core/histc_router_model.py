"""A runner-shaped decoder whose router counts the tokens each expert gets with ``torch.histc``
(as transformers' ``grouped_mm`` experts do): ``aten.histc`` is outside Core ATen and has no
decomposition, so no ExecuTorch program can hold it.

``case()`` is the model file factory (tokens [1, 1], positions [1] -> logits) for
``writeback run/export/explain tests/core/histc_router_model.py:case``; ``counted_case()`` counts
with a one-hot sum instead (Core ATen), the same numbers, and exports.
"""

from __future__ import annotations

import torch
from writeback_core.llm_runner import runner_metadata
from writeback_core.types import ModelCase

VOCAB, DIM, EXPERTS = 16, 8, 4


class Router(torch.nn.Module):
    """Picks each token's top-2 experts and returns how many tokens each expert got."""

    def __init__(self, histc: bool) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(DIM, EXPERTS)
        self.histc = histc

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        chosen = self.gate(hidden).topk(2, dim=-1).indices.reshape(-1)
        if self.histc:
            return torch.histc(chosen.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        return torch.nn.functional.one_hot(chosen, EXPERTS).sum(0).float()


class RoutedDecoder(torch.nn.Module):
    def __init__(self, histc: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.router = Router(histc)
        self.head = torch.nn.Linear(DIM + EXPERTS, VOCAB)
        self.register_buffer("seen", torch.zeros(EXPERTS))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        self.seen.add_(self.router(hidden))
        logits: torch.Tensor = self.head(torch.cat([hidden, self.seen.expand(1, 1, EXPERTS)], dim=-1))
        return logits


def _case(histc: bool) -> ModelCase:
    return ModelCase(
        name="histc-router" if histc else "one-hot-router",
        description="a router counting tokens per expert with " + ("torch.histc" if histc else "a one-hot sum"),
        build=lambda: RoutedDecoder(histc),
        step_inputs=lambda step: (torch.tensor([[step % VOCAB]]), torch.tensor([step])),
        constant_methods=runner_metadata(
            max_seq_len=1, max_context_len=32, vocab_size=VOCAB, bos_id=0, eos_ids=[1], dynamic_shape=False
        ),
    )


def case() -> ModelCase:
    return _case(True)


def counted_case() -> ModelCase:
    return _case(False)
