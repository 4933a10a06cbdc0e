# torch types a registered buffer as ``Tensor | Module``, so calls like ``buf.index_copy_``
# and indexing a ModuleDict read as errors to mypy.
# mypy: disable-error-code="operator,index"
"""Small models for the trt-copyback tests, each with a known split of aliased and copy-back state."""

from __future__ import annotations

import torch
from torch import nn
from writeback.zoo import DecoderConfig, EmaStat, GatedDeltaState, TinyDecoder


class Hybrid(nn.Module):
    """A decoder step with a KV cache, a Gated-DeltaNet-like state and an EMA statistic.

    KV caches ``decoder.blocks.0.{k,v}_cache`` (4-D, written on the sequence dim:
    aliased); ``gdn.conv_state`` / ``gdn.recurrent_state`` (updated whole: copy-back);
    ``ema.running_mean`` / ``ema.steps`` (read before written: copy-back, warned).
    """

    def __init__(self) -> None:
        super().__init__()
        self.decoder = TinyDecoder(DecoderConfig())
        self.gdn = GatedDeltaState(dim=16)
        self.ema = EmaStat(dim=8)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.decoder(tokens, pos)
        mixed = self.gdn(logits[0, :, :16])
        return logits, self.ema(mixed.view(2, 8))


def hybrid_inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([[(5 * step + 1) % 64]]), torch.tensor([step])


class SliceWrite(nn.Module):
    """``cache[index] = x`` into a buffer of ``shape``, then a read of the cache."""

    def __init__(self, shape: tuple[int, ...], index: tuple[slice | int, ...], read: bool = True) -> None:
        super().__init__()
        self.index = index
        self.read = read
        self.register_buffer("cache", torch.zeros(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[self.index] = x
        if self.read:
            return self.cache.sum(-1) * 2.0
        return x.sum() * 2.0


class IndexCopyWrite(nn.Module):
    """``cache.index_copy_(dim, pos, x)`` into a buffer of ``shape``, then a read of the cache."""

    def __init__(self, shape: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("cache", torch.zeros(shape))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(self.dim, pos, x)
        return self.cache.sum(-1) + 1.0


class ClonedWrite(nn.Module):
    """The clone / write / write-back shape: ``k = cache.clone(); k[...] = x; cache.copy_(k)``.

    ``shared`` also reads the cache itself, so the clone has company and stays.
    ``op`` is ``"slice"`` or ``"index_copy"``.
    """

    def __init__(self, op: str = "slice", shared: bool = False) -> None:
        super().__init__()
        self.op, self.shared = op, shared
        self.register_buffer("cache", torch.zeros(1, 2, 16, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        k = self.cache.clone()
        if self.op == "slice":
            k[:, :, 3:4, :] = x
        else:
            k.index_copy_(2, pos, x)
        out = k.sum(dim=-1)
        if self.shared:
            out = out + self.cache.sum(dim=-1)
        self.cache.copy_(k)
        return out


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, 8, 4))
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k_cache.index_copy_(2, pos, x)
        self.state.mul_(0.5).add_(x.mean((0, 1, 2)))
        return self.k_cache.sum((-1, -2)) + self.state.sum()


class Nested(nn.Module):
    """Buffers two submodules deep: ``layers.{0,1}.attn.k_cache`` and ``layers.{0,1}.attn.state``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"attn": Attn()}) for _ in range(2))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.layers[0]["attn"](x, pos)
        return out + self.layers[1]["attn"](x * 2.0, pos)


class ThreeStates(nn.Module):
    """Three copy-back buffers of different shapes; the user output is none of them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(3))
        self.register_buffer("b", torch.ones(2, 2))
        self.register_buffer("c", torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a.add_(x)
        self.b.mul_(2.0).add_(x)
        self.c.sub_(x * 3.0)
        return x * 3.0


class ReturnsWritten(nn.Module):
    """Returns the very value it writes back into its buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.state * 0.5 + x
        self.state.copy_(new)
        return new


class Overwrite(nn.Module):
    """A buffer replaced whole without reading it: its initial value never matters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last.copy_(x * 2.0)
        return x + 1.0


class DeadAndLive(nn.Module):
    """``dead`` is written and never read (re-routed, marked); ``live`` is written and read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("dead", torch.zeros(1, 2, 16, 4))
        self.register_buffer("live", torch.zeros(1, 2, 16, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.dead[:, :, 3:4, :] = x
        self.live.index_copy_(2, pos, x)
        return self.live.sum(-1)


class ReadOutside(nn.Module):
    """The cache's old value is read by ``amax`` (keep it out of the engine to make it outside)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 2, 16, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        old = self.cache.amax()
        self.cache.index_copy_(2, pos, x)
        return self.cache.sum(-1) + old


class ReadLater(nn.Module):
    """The old cache is read (through a clone) by ops that depend on the write's result.

    With ``amax`` kept out of the engine, the ops after it form a second partition that
    reads the cache after the first partition has written it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 2, 16, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        old = self.cache.clone()
        self.cache.index_copy_(2, pos, x)
        peak = self.cache.sum(-1).amax()
        return (old * peak).sum(-1)
