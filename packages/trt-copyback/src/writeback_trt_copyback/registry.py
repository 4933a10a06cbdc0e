"""The engines a registry offers (``writeback_engines``), by name, duplicates refused."""

from __future__ import annotations

from writeback_core.registry import DuplicateNameError, Registry
from writeback_core.types import AliasingEngine

__all__ = ["DuplicateEngineError", "engines_of"]

# Two plugins offering an engine of the same name: what core's Registry.engines raises.
DuplicateEngineError = DuplicateNameError


def engines_of(registry: Registry) -> dict[str, AliasingEngine]:
    """Every engine the plugins of ``registry`` offer, keyed by ``name`` (core's ``Registry.engines``).

    Raises :class:`DuplicateEngineError` naming both plugins when two offer one name.
    """
    return registry.engines()
