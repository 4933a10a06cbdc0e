"""Helpers for the hostile-blob tests of every delegate: walk a decoded JSON blob field by
field and give each field values of other JSON types."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any


def fields(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into ``value`` (the root's ``()`` first), depth first."""
    yield path
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from fields(inner, (*path, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from fields(inner, (*path, index))


def at(record: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        record = record[key]
    return record


def wrong_values(value: Any, ref_tag: str) -> list[Any]:
    """Values of other JSON types than ``value`` (``ref_tag`` spells the delegate's reference)."""
    if value is None:
        return [{ref_tag: 7}, "x"]
    if isinstance(value, bool):
        return ["yes", 1.5]
    if isinstance(value, int):
        return ["3", 2.5, None, [value]]
    if isinstance(value, str):
        return [7, None, [value], {ref_tag: value}]
    if isinstance(value, list):
        return [{"x": 1}, "list"]
    return [[1], "object"]


def replaced(record: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A deep copy of ``record`` with the field at ``path`` set to ``value``."""
    changed = copy.deepcopy(record)
    at(changed, path[:-1])[path[-1]] = value
    return changed
