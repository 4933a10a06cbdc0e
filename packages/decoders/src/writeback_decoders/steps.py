"""Decode steps of a real decoder: the token fed back is the one eager PyTorch picks.

A :class:`~writeback_core.types.ModelCase`'s inputs must be a pure function of the
step (the pipeline asks ``step_inputs(step)`` once for the runtime and once for
eager), so the greedy token sequence is worked out once, from a private eager
copy of the model, and cached: :class:`GreedyTokens`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["GreedyTokens", "cache_positions", "seeded"]


class GreedyTokens:
    """The token and the cache position of every decode step, as greedy decoding makes them.

    Step 0 feeds ``prompt`` at position 0. Step ``s`` feeds, at position
    ``s % max_seq``, the argmax of the logits eager PyTorch returned at step
    ``s - 1``. The sequence is computed on first use, step by step, by a private
    eager copy of the model built with ``build`` (fed through ``call(module,
    token, position)``, which returns that step's logits), and cached: asking
    for step 40 runs eager steps 0 to 39 once, and later calls cost nothing.
    Once every cache slot is written, the position starts over at 0 and the
    model overwrites its oldest entries (both the program and eager do the same).

    A caller that already runs the steps hands each step's logits to :meth:`observe`,
    and the next token is their argmax: no eager copy is built.

    The eager copy, and the cache it holds, stays alive while the sequence may
    grow; :meth:`release` drops it (rebuilt and replayed from step 0 when a later
    step is asked for).
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        call: Callable[[nn.Module, int, int], torch.Tensor],
        max_seq: int,
        prompt: int = 1,
    ) -> None:
        if max_seq < 1:
            raise ValueError(f"max_seq must be at least 1, got {max_seq}")
        self._build = build
        self._call = call
        self.max_seq = max_seq
        self.prompt = prompt
        self._tokens = [prompt]
        self._module: nn.Module | None = None
        self._fed = 0  # steps the eager copy has run

    def position(self, step: int) -> int:
        """The cache slot written at ``step``."""
        if step < 0:
            raise ValueError(f"decode step must be >= 0, got {step}")
        return step % self.max_seq

    def token(self, step: int) -> int:
        """The token fed at ``step`` (runs eager up to ``step - 1`` the first time)."""
        if step < 0:
            raise ValueError(f"decode step must be >= 0, got {step}")
        while len(self._tokens) <= step:
            if self._module is None:
                self._module = self._build().eval().requires_grad_(False)
                self._fed = 0
            # The eager copy has run steps [0, _fed); run it up to the last known token.
            while self._fed < len(self._tokens):
                with torch.no_grad():
                    logits = self._call(self._module, self._tokens[self._fed], self.position(self._fed))
                self._fed += 1
            next_token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
            self._tokens.append(next_token)
        return self._tokens[step]

    def observe(self, step: int, logits: torch.Tensor) -> None:
        """Take the token of step ``step + 1`` from ``logits``, the logits of step ``step``
        computed elsewhere (a run's eager reference, or the program when nothing checks it),
        so no private eager copy is built. Ignored when that token is known already or an
        earlier one is missing."""
        if step + 1 == len(self._tokens) and step >= 0:
            self._tokens.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))

    def tokens(self, steps: int) -> list[int]:
        """The tokens fed at steps ``0 .. steps - 1``."""
        if steps > 0:
            self.token(steps - 1)
        return list(self._tokens[:steps])

    def release(self) -> None:
        """Drop the eager copy (the tokens computed so far stay cached)."""
        self._module = None
        self._fed = 0


def cache_positions(cache_mib: float, layers: int, kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
    """How many cache positions make a K+V cache of ``cache_mib`` MiB (at least 8).

    Each position holds a key and a value of ``kv_heads * head_dim`` elements
    per layer (batch 1); the result is rounded down.
    """
    if not cache_mib > 0:
        raise ValueError(f"cache size must be a positive number of MiB, got {cache_mib}")
    per_position = layers * 2 * kv_heads * head_dim * itemsize
    return max(8, int(cache_mib * (1 << 20)) // per_position)


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with torch's global generator seeded by ``seed``, restored afterwards.

    Random initialisation in torch and transformers draws from the global
    generator: seeding it makes two builds identical, restoring it leaves the
    caller's random stream as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval().requires_grad_(False)
