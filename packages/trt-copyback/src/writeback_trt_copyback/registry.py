"""The engines a registry offers (``writeback_engines``), by name, duplicates refused."""

from __future__ import annotations

from writeback_core.registry import Registry
from writeback_core.types import AliasingEngine

__all__ = ["DuplicateEngineError", "engines_of"]


class DuplicateEngineError(ValueError):
    """Two plugins offered an engine of the same name."""


def engines_of(registry: Registry) -> dict[str, AliasingEngine]:
    """Every engine the plugins of ``registry`` offer, keyed by ``name``.

    Plugins are read in name order, so hook order never changes the result.
    Raises :class:`DuplicateEngineError` naming both plugins when two offer one name.
    """
    caller = registry.hook.writeback_engines
    offered = sorted(((impl.plugin_name, impl.function()) for impl in caller.get_hookimpls()), key=lambda item: item[0])
    found: dict[str, tuple[str, AliasingEngine]] = {}
    for plugin, engines in offered:
        for engine in engines or ():
            if engine.name in found:
                raise DuplicateEngineError(
                    f"engine {engine.name!r} is offered by both plugin {found[engine.name][0]!r} "
                    f"and plugin {plugin!r}; block one with WRITEBACK_BLOCK_PLUGINS={plugin}"
                )
            found[engine.name] = (plugin, engine)
    return {name: engine for name, (_, engine) in found.items()}
