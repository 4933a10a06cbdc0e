"""Built-in stateful models: deterministic, seeded, no downloaded weights.

Each :class:`ModelCase` builds a fresh module and the inputs of each call. By
convention ``forward(*step_inputs, *state, **step_kwargs)``: the per-call inputs
first, then any caller-owned state tensors (which the model mutates in place),
then the per-call keyword arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from writeback_core.types import ModelCase

if TYPE_CHECKING:
    pass

__all__ = [
    "CallerCacheDecoder",
    "CounterNoInput",
    "DecoderConfig",
    "EmaStat",
    "GatedDeltaState",
    "TinyDecoder",
    "builtin_models",
    "decoder_case",
]


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the tiny decoder. Each layer's K and V cache is ``[1, heads, max_seq, head_dim]``.

    ``window``: ``None`` attends over every cache slot (masked past the current
    position); an int attends over the last ``window`` positions only (sliding
    window attention, gathered from the cache by index), so a step's arithmetic
    does not grow with ``max_seq``.
    """

    vocab: int = 64
    dim: int = 32
    heads: int = 2
    max_seq: int = 16
    layers: int = 1
    hidden: int = 64
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and not 1 <= self.window <= self.max_seq:
            raise ValueError(f"window {self.window} must be between 1 and max_seq {self.max_seq}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (1, self.heads, self.max_seq, self.head_dim)

    @classmethod
    def for_cache_bytes(
        cls, nbytes: int, heads: int = 8, head_dim: int = 64, window: int | None = None
    ) -> DecoderConfig:
        """A one-layer config whose K and V caches (fp32) hold ``nbytes`` together.

        ``window`` is clipped to the cache's length.
        """
        max_seq = max(8, nbytes // (2 * heads * head_dim * 4))
        return cls(
            vocab=64,
            dim=heads * head_dim,
            heads=heads,
            max_seq=max_seq,
            layers=1,
            hidden=2 * heads * head_dim,
            window=None if window is None else min(window, max_seq),
        )


def _seeded(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def _init_(module: nn.Module, seed: int) -> None:
    gen = _seeded(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (1.0 / math.sqrt(param.shape[-1])))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Attention over a static cache written at ``input_pos`` with ``index_copy_``."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.cfg
        seq = x.shape[1]
        q = self.wq(x).view(1, seq, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(1, seq, cfg.heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(1, seq, cfg.heads, cfg.head_dim).transpose(1, 2)
        k_cache.index_copy_(2, input_pos, k)
        v_cache.index_copy_(2, input_pos, v)
        query_pos = input_pos.view(seq, 1)
        if cfg.window is None:
            keys, values = k_cache, v_cache
            positions = torch.arange(cfg.max_seq).view(1, cfg.max_seq)
            visible = positions <= query_pos
        else:
            # Every query's last ``window`` positions, gathered by index (``window``
            # slots when decoding one token): slots before position 0 are clamped
            # to 0 and masked out, like each query's positions outside its window.
            span = cfg.window + seq - 1
            positions = input_pos[-1] - (span - 1) + torch.arange(span)
            slots = positions.clamp(min=0)
            keys, values = k_cache.index_select(2, slots), v_cache.index_select(2, slots)
            positions = positions.view(1, span)
            visible = (positions >= 0) & (positions <= query_pos) & (positions > query_pos - cfg.window)
        mask = torch.where(visible, 0.0, float("-inf"))
        scores = q @ keys.transpose(2, 3) / math.sqrt(cfg.head_dim) + mask
        out = torch.softmax(scores, dim=-1) @ values
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(1, seq, cfg.dim))
        return projected


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), input_pos, k_cache, v_cache)
        h = self.mlp_norm(x)
        mlp: torch.Tensor = self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))
        return x + mlp


class _DecoderBody(nn.Module):
    def __init__(self, cfg: DecoderConfig, seed: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        _init_(self, seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)

    def run(self, tokens: torch.Tensor, input_pos: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, input_pos, caches[2 * i], caches[2 * i + 1])
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


class TinyDecoder(_DecoderBody):
    """A decoder whose KV caches are registered buffers ``blocks.{i}.k_cache`` / ``v_cache``."""

    def __init__(self, cfg: DecoderConfig | None = None, seed: int = 0) -> None:
        cfg = cfg or DecoderConfig()
        super().__init__(cfg, seed)
        for block in self.blocks:
            block.register_buffer("k_cache", torch.zeros(cfg.cache_shape))
            block.register_buffer("v_cache", torch.zeros(cfg.cache_shape))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        caches = [c for b in self.blocks for c in (b.k_cache, b.v_cache)]
        # A registered buffer read as a module attribute is typed Tensor | Module.
        return self.run(tokens, input_pos, caches)  # type: ignore[arg-type]  # buffers, see above


class CallerCacheDecoder(_DecoderBody):
    """The same decoder with the KV caches owned by the caller: ``forward(tokens, pos, *caches)``."""

    def __init__(self, cfg: DecoderConfig | None = None, seed: int = 0) -> None:
        super().__init__(cfg or DecoderConfig(), seed)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *caches: torch.Tensor) -> torch.Tensor:
        return self.run(tokens, input_pos, list(caches))


class GatedDeltaState(nn.Module):
    """A Gated-DeltaNet-like layer: a conv window shifted each step and a recurrent state
    updated whole (decay, then a rank-1 delta update), both registered buffers."""

    def __init__(self, dim: int = 16, heads: int = 2, kernel: int = 4, seed: int = 1) -> None:
        super().__init__()
        self.heads, self.dk = heads, dim // heads
        self.proj = nn.Linear(dim, 3 * dim, bias=False)
        self.gate = nn.Linear(dim, heads, bias=False)
        self.conv_weight = nn.Parameter(torch.ones(dim, kernel))
        _init_(self, seed)
        self.conv_state: torch.Tensor
        self.recurrent_state: torch.Tensor
        self.register_buffer("conv_state", torch.zeros(1, dim, kernel))
        self.register_buffer("recurrent_state", torch.zeros(1, heads, self.dk, self.dk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window = torch.cat([self.conv_state[:, :, 1:], x.view(1, -1, 1)], dim=-1)
        self.conv_state.copy_(window)
        mixed = (window * self.conv_weight).sum(-1)
        q, k, v = self.proj(mixed).view(3, self.heads, self.dk).unbind(0)
        k = torch.nn.functional.normalize(k, dim=-1)
        decay = torch.sigmoid(self.gate(mixed)).view(1, self.heads, 1, 1)
        state = self.recurrent_state * decay
        predicted = (state * k.view(1, self.heads, self.dk, 1)).sum(2)
        delta = v.view(1, self.heads, self.dk) - predicted
        state = state + k.view(1, self.heads, self.dk, 1) * delta.view(1, self.heads, 1, self.dk)
        self.recurrent_state.copy_(state)
        out: torch.Tensor = (state * q.view(1, self.heads, self.dk, 1)).sum(2).reshape(1, -1)
        return out


class EmaStat(nn.Module):
    """A running mean buffer read before it is written (batch-norm style statistic)."""

    def __init__(self, dim: int = 8, momentum: float = 0.1) -> None:
        super().__init__()
        self.momentum = momentum
        self.running_mean: torch.Tensor
        self.steps: torch.Tensor
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - self.running_mean
        self.running_mean.mul_(1.0 - self.momentum).add_(self.momentum * x.mean(0))
        self.steps.add_(1)
        return centered


class CounterNoInput(nn.Module):
    """A model with no inputs: each call bumps a counter and returns it doubled."""

    def __init__(self) -> None:
        super().__init__()
        self.count: torch.Tensor
        self.increment: torch.Tensor
        self.register_buffer("count", torch.zeros(2))
        self.register_buffer("increment", torch.tensor([1.0, 0.5]))

    def forward(self) -> torch.Tensor:
        self.count.add_(self.increment)
        return self.count + self.count


def _token_inputs(cfg: DecoderConfig) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def inputs(step: int) -> tuple[torch.Tensor, ...]:
        token = (7 * step + 3) % cfg.vocab
        return (torch.tensor([[token]], dtype=torch.int64), torch.tensor([step % cfg.max_seq], dtype=torch.int64))

    return inputs


def decoder_case(cfg: DecoderConfig | None = None, caller_cache: bool = False) -> ModelCase:
    """The tiny decoder as a case; ``caller_cache`` passes the KV caches as inputs."""
    cfg = cfg or DecoderConfig()
    if caller_cache:
        return ModelCase(
            name="decoder-caller-cache",
            description="tiny decoder, KV cache owned by the caller and passed as inputs",
            build=lambda: CallerCacheDecoder(cfg),
            step_inputs=_token_inputs(cfg),
            make_state=lambda: tuple(torch.zeros(cfg.cache_shape) for _ in range(2 * cfg.layers)),
            sized=lambda mib: decoder_case(DecoderConfig.for_cache_bytes(int(mib * (1 << 20))), caller_cache=True),
        )
    return ModelCase(
        name="decoder",
        description="tiny decoder, KV cache in registered buffers written by index_copy_",
        build=lambda: TinyDecoder(cfg),
        step_inputs=_token_inputs(cfg),
        sized=lambda mib: decoder_case(DecoderConfig.for_cache_bytes(int(mib * (1 << 20)))),
    )


def _vector_inputs(shape: tuple[int, ...], seed: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def inputs(step: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(shape, generator=_seeded(seed + step)),)

    return inputs


def builtin_models() -> dict[str, ModelCase]:
    """The zoo, keyed by name."""
    cases = [
        decoder_case(),
        decoder_case(caller_cache=True),
        ModelCase(
            name="recurrent",
            description="Gated-DeltaNet-like conv window and recurrent state, updated whole",
            build=GatedDeltaState,
            step_inputs=_vector_inputs((1, 16), seed=10),
        ),
        ModelCase(
            name="ema",
            description="running-mean buffer read before it is written, plus a step counter",
            build=EmaStat,
            step_inputs=_vector_inputs((4, 8), seed=20),
        ),
        ModelCase(
            name="no-input",
            description="no inputs: a counter buffer bumped each call",
            build=CounterNoInput,
            step_inputs=lambda step: (),
        ),
    ]
    return {case.name: case for case in cases}
