"""A decoded delegate program's steps, shared by the runtime and its attention windows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from writeback_mlx_backend.ops import OpHandler


@dataclass(frozen=True)
class Ref:
    """An argument that names a value: an input, a constant, a state buffer or a step."""

    name: str


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


def resolve(value: Any, env: Mapping[str, Any]) -> Any:
    """``value`` with each reference replaced by its value in ``env``."""
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, list):
        return [resolve(v, env) for v in value]
    return value


def call(step: Step, args: Any, kwargs: Mapping[str, Any], traced: bool) -> Any:
    """Run ``step`` on resolved arguments (its traced form when ``traced``), cast to its dtype."""
    handler = step.handler
    value = (handler.trace or handler.run)(*args, **kwargs) if traced else handler.run(*args, **kwargs)
    if step.dtype is not None and value.dtype != step.dtype:
        value = value.astype(step.dtype)
    return value
