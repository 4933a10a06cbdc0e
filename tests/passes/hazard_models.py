"""Small models, one per hazard of the early write-back pass, each with mutated state zeroed at start.

Every model mutates only buffers that start at zero, because exir serializes
mutated buffers without their initial values.
"""

from __future__ import annotations

import torch
from torch import nn


def seeded(seed: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return torch.randn(shape, generator=gen)


class Plain(nn.Module):
    """State updated from the input, then a long tail that never reads the state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.state * 0.5 + x
        self.state.copy_(new)
        h = torch.sin(x) * 3
        return torch.cos(h) + h


class OldReadAfterNew(nn.Module):
    """The new value is computed first; the old state is read after it, then written."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = x * 2 + 1
        old = self.state * 3 + x
        self.state.copy_(new)
        return old


class ReadThroughView(nn.Module):
    """A view of the state taken first and read after the (independent) new value is ready."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = self.state.view(4, 4)
        new = x * 3 + 1
        read = view * 2 + 0.5
        self.state.copy_(new)
        return read


class ValueAliasesOtherBuffer(nn.Module):
    """``a`` takes ``b``'s old contents through a view (its value aliases ``b``) while ``b``
    gets a new value; ``a``'s old contents are read late, so ``a``'s copy would land
    after ``b``'s if each were placed on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(16))
        self.register_buffer("b", torch.zeros(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b_new = x.view(4, 4) * 2 + self.b
        snapshot = self.b.view(16)
        out = torch.sin(x) + self.a
        self.a.copy_(snapshot)
        self.b.copy_(b_new)
        return out


class SharedAllocation(nn.Module):
    """``state[0:4] = y`` can share the state's allocation (exir's reinplace annotation);
    the result is read after the state's final value is ready."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        final = x * 3
        self.state[0:4] = x[0:4] + 1
        read = self.state * 2
        self.state.copy_(final)
        return read


class NoPlaceholder(nn.Module):
    """No inputs, no parameters, no buffers: a graph without placeholders."""

    def forward(self) -> torch.Tensor:
        return torch.ones(3) * 2


class Stateless(nn.Module):
    """Nothing to write back."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(seeded(3, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.weight) + 1


class EarlyReady(nn.Module):
    """The new state is ready at once and followed by large temporaries (the memory case)."""

    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(n, n))
        self.weight = nn.Parameter(seeded(4, n, n) / n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state.add_(x)
        h = torch.relu(self.weight @ self.weight)
        h = torch.tanh(h @ self.weight)
        return (h @ self.weight).sum(0)


class ValueAliasesEarlierBuffer(nn.Module):
    """Like :class:`ValueAliasesOtherBuffer`, but ``b`` comes first in the signature, so exir's
    own end-of-graph order overwrites ``b`` before ``a`` takes its old contents."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.zeros(4, 4))
        self.register_buffer("a", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b_new = x.view(4, 4) * 2 + self.b
        snapshot = self.b.view(16)
        out = torch.sin(x) + self.a
        self.a.copy_(snapshot)
        self.b.copy_(b_new)
        return out
