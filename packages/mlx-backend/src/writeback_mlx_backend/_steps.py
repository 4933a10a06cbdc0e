"""A decoded delegate program's steps, shared by the runtime and its attention windows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from writeback_core.blob import Ref, resolve
from writeback_core.ops import normalize_dim

from writeback_mlx_backend.op_handler import OpHandler
from writeback_mlx_backend.op_indexing import INDEX_COPY, INDEX_PUT


@dataclass(frozen=True)
class Step:
    """One node of the program: ``name = handler.run(*args, **kwargs)``, cast to ``dtype``."""

    name: str
    op: str
    handler: OpHandler
    args: Any
    kwargs: dict[str, Any]
    dtype: Any


def refs(value: Any) -> list[str]:
    """The names ``value`` refers to, in order."""
    if isinstance(value, Ref):
        return [value.name]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in refs(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in refs(v)]
    return []


def resolve_kwargs(kwargs: Mapping[str, Any], env: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each reference replaced by its value in ``env``."""
    return {k: resolve(v, env) for k, v in kwargs.items()}


def call(step: Step, args: Any, kwargs: Mapping[str, Any], traced: bool) -> Any:
    """Run ``step`` on resolved arguments (its traced form when ``traced``), cast to its dtype."""
    handler = step.handler
    value = (handler.trace or handler.run)(*args, **kwargs) if traced else handler.run(*args, **kwargs)
    if step.dtype is not None and value.dtype != step.dtype:
        value = value.astype(step.dtype)
    return value


def call_resolved(step: Step, env: Mapping[str, Any], traced: bool) -> Any:
    """Run ``step`` on its arguments looked up in ``env`` (see :func:`call`)."""
    return call(step, resolve(step.args, env), resolve_kwargs(step.kwargs, env), traced)


def step_axis(step: Step, dim: Any, rank: int) -> int:
    """A literal dim of ``step`` as an axis in ``[0, rank)``, by core's ``normalize_dim``; an
    error names the step and its op."""
    return normalize_dim(dim, rank, what=f"{step.name} ({step.op}) dim")


def index_write_axes(step: Step, rank: int) -> list[int]:
    """The axes an index write of rank ``rank`` writes along: ``index_copy``'s dim, or the
    positions ``index_put`` indexes (none when it accumulates); none for any other step."""
    if step.op == INDEX_COPY:
        return [step_axis(step, step.args[1], rank)]
    if step.op == INDEX_PUT and not (len(step.args) > 3 and step.args[3]):
        return [position for position, index in enumerate(step.args[1]) if index is not None]
    return []
