"""What the fusions share: the name a step's argument refers to, each value's traced shape
and dtype (:data:`Info`), and replacing each matched chain by one step (:func:`replace_chains`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.blob import Ref
from writeback_core.ops import normalize_dim

from writeback_mlx_backend._steps import Step, refs


def never(node: Any) -> str:
    """The ``check`` of a fused step's handler: no node is ever delegated as one."""
    return "made by the runtime, never lowered"


def ref(value: Any) -> str | None:
    """The name ``value`` refers to, when it is a :class:`Ref`."""
    return value.name if isinstance(value, Ref) else None


# What a value is before the call: its shape and dtype, from a lazy pass over the steps.
Info = Mapping[str, tuple[tuple[int, ...], Any]]

RESHAPES = ("aten.view_copy.default", "aten.unsqueeze_copy.default", "aten.squeeze_copy.dims")


def replace_chains(
    steps: Sequence[Step],
    kept: Sequence[str],
    fuse: Callable[[Step, Mapping[str, Step]], tuple[set[str], Step] | None],
) -> tuple[dict[str, Step], set[str], dict[str, Step], dict[str, set[str]]]:
    """Each step ``fuse`` matches (with the chain's inner steps) and the step taking its place,
    where nothing outside the chain reads an inner value and no chain overlaps another:
    ``(fused by name, inner steps dropped, the steps by name, each value's readers)``."""
    readers: dict[str, set[str]] = {}
    for step in steps:
        for name in refs((step.args, step.kwargs)):
            readers.setdefault(name, set()).add(step.name)
    producers = {s.name: s for s in steps}
    fused: dict[str, Step] = {}
    dropped: set[str] = set()
    for step in steps:
        found = fuse(step, producers)
        if found is None:
            continue
        inner, replacement = found
        chain = inner | {step.name}
        if any(n in kept or not readers.get(n, set()) <= chain for n in inner) or inner & (dropped | set(fused)):
            continue
        fused[step.name] = replacement
        dropped |= inner
    return fused, dropped, producers, readers


def shape_of(name: str | None, info: Info) -> tuple[int, ...]:
    """The traced shape of the value ``name``; ``()`` where it is not known."""
    return info[name][0] if name is not None and name in info else ()


def last_axis(dim: Any, name: str | None, info: Info) -> bool:
    """Whether literal ``dim`` names the last axis of the value ``name`` at its traced rank
    (``3`` is the last axis at rank 4 only); ``False`` where the rank is not known."""
    rank = len(shape_of(name, info))
    if not rank:
        return False
    try:
        return normalize_dim(dim, rank) == rank - 1
    except (IndexError, TypeError):
        return False


def dtype_is(dtype: Any, *choices: Any) -> bool:
    """``dtype`` is one of ``choices`` (an MLX dtype refuses to be compared with ``None``)."""
    return dtype is not None and any(dtype == c for c in choices)


def fp32(name: str | None, info: Info) -> bool:
    """Whether the value ``name`` is traced as fp32."""
    return name is not None and name in info and dtype_is(info[name][1], mx.float32)
