"""A decoder whose state is dropped by ``torch.export`` as transformers 5.23 drops Falcon-H1's:
a cache object (not a module) allocates its state on the first call and writes it in place
afterwards, beside a registered counter buffer the program does keep. Eager PyTorch carries the
state from call to call; the exported program creates it afresh (zeros) every call.

``case()`` is a runner-shaped model file factory (tokens [1, 1], positions [1] -> logits), for
``writeback run/export/explain tests/core/lazy_state_model.py:case``; ``kept_case()`` is the
same model with the state allocated in ``__init__`` and registered as a buffer, which exports
whole.
"""

from __future__ import annotations

import torch
from writeback_core.llm_runner import runner_metadata
from writeback_core.types import ModelCase

VOCAB, DIM = 16, 8


class LazyStates:
    """A cache object holding one state, allocated by the first ``update``."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None

    def update(self, x: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            self.state = torch.zeros_like(x)
        self.state.mul_(0.5).add_(x)
        return self.state


class LazyStateDecoder(torch.nn.Module):
    def __init__(self, registered: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.cache = LazyStates()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.registered = registered
        if registered:  # the fix the error asks for: allocated up front, a registered buffer
            self.register_buffer("state", torch.zeros(1, 1, DIM))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.registered:
            self.cache.state = self.state  # the buffer itself (export traces it as one)
        self.calls.add_(1)
        hidden = self.cache.update(self.embed(tokens))
        logits: torch.Tensor = self.head(hidden)
        return logits


def _case(registered: bool) -> ModelCase:
    return ModelCase(
        name="lazy-state" + ("-registered" if registered else ""),
        description="a cache object's state allocated on the first call" + (", registered" if registered else ""),
        build=lambda: LazyStateDecoder(registered),
        step_inputs=lambda step: (torch.tensor([[step % VOCAB]]), torch.tensor([step])),
        constant_methods=runner_metadata(
            max_seq_len=1, max_context_len=32, vocab_size=VOCAB, bos_id=0, eos_ids=[1], dynamic_shape=False
        ),
    )


def case() -> ModelCase:
    return _case(False)


def kept_case() -> ModelCase:
    return _case(True)
