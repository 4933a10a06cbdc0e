"""Two caches written by ExecuTorch's ``llama::update_cache`` at a position read from a tensor
(``pos[0].item()``), as its Llama example and LLM runner write theirs: a model for the tests
of a state an op writes in place (explained as a file factory, ``update_cache_model.py:make``)."""

from __future__ import annotations

import importlib

import torch

# The op's eager kernel and export meta function ship in the executorch wheel.
importlib.import_module("executorch.extension.llm.custom_ops.custom_ops")

SLOTS = 8


class UpdateCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("key_cache", torch.zeros(1, SLOTS, 2, 4))  # [batch, position, head, dim]
        self.register_buffer("value_cache", torch.zeros(1, SLOTS, 2, 4))

    def forward(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        start = pos[0].item()
        torch._check(start >= 0)
        torch._check(start + k.shape[1] <= SLOTS)
        torch.ops.llama.update_cache(k, self.key_cache, start)
        torch.ops.llama.update_cache(k * 2, self.value_cache, start)
        return self.key_cache.sum() + self.value_cache.sum()


def make() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return UpdateCache(), (torch.ones(1, 1, 2, 4), torch.tensor([3]))
