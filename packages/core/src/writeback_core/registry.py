"""The plugin registry: one pluggy ``PluginManager`` per :class:`Registry`, never a global.

``load_registry`` builds one; nothing is loaded at import time. Environment:

- ``WRITEBACK_BLOCK_PLUGINS``: comma-separated plugin names (entry-point names)
  that are never loaded.
- ``WRITEBACK_TRACE_PLUGINS``: when set to ``1``, every hook call is traced to stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy
import torch.fx
from torch.export import ExportedProgram

from writeback_core import hookspecs, meta
from writeback_core._name import NAME
from writeback_core.mutations import Mutation
from writeback_core.types import (
    AliasingEngine,
    BackendSpec,
    PartitionView,
    ProgramPass,
    RuntimeDelegate,
    RuntimeSpec,
    Stage,
    StateAllocator,
)

__all__ = [
    "BLOCK_ENV",
    "TRACE_ENV",
    "InPlaceConflictError",
    "InPlaceDecision",
    "Registry",
    "hookimpl",
    "load_registry",
]

hookimpl = pluggy.HookimplMarker(NAME)

BLOCK_ENV = "WRITEBACK_BLOCK_PLUGINS"
TRACE_ENV = "WRITEBACK_TRACE_PLUGINS"
BUILTIN_NAME = "writeback-core"


class InPlaceConflictError(ValueError):
    """Two plugins answered the per-mutation hook differently for one mutation."""


class DuplicateNameError(ValueError):
    """Two plugins offered the same backend, delegate or model name."""


@dataclass(frozen=True)
class InPlaceDecision:
    """Core's decision for one mutation: does ``backend`` write it in place?

    ``accepted_by`` / ``declined_by`` name the plugins that answered; when no
    plugin answered, the mutation is copied back (``accepted`` is False).
    """

    backend: str
    target: str
    placeholder: str
    write: str
    accepted: bool
    accepted_by: tuple[str, ...]
    declined_by: tuple[str, ...]

    def to_meta(self) -> dict[str, Any]:
        """The plain dict stored under ``node.meta["custom"][meta.IN_PLACE]``."""
        return {
            "backend": self.backend,
            "target": self.target,
            "write": self.write,
            "accepted": self.accepted,
            "accepted_by": list(self.accepted_by),
            "declined_by": list(self.declined_by),
        }

    @classmethod
    def from_node(cls, node: torch.fx.Node) -> InPlaceDecision | None:
        """Read the decision recorded on a placeholder, or ``None`` if it has none."""
        record = meta.get_custom(node, meta.IN_PLACE)
        if not isinstance(record, dict):
            return None
        return cls(
            backend=str(record["backend"]),
            target=str(record["target"]),
            placeholder=node.name,
            write=str(record["write"]),
            accepted=bool(record["accepted"]),
            accepted_by=tuple(record["accepted_by"]),
            declined_by=tuple(record["declined_by"]),
        )


def _plugin_label(plugin: object) -> str | None:
    name = getattr(plugin, "writeback_name", None)
    if isinstance(name, str):
        return name
    return None


class Registry:
    """The plugins of one process, and the hook calls the pipeline makes on them."""

    def __init__(self, manager: pluggy.PluginManager) -> None:
        self.manager = manager

    @property
    def hook(self) -> Any:
        """The pluggy hook relay, for hooks this class has no helper for."""
        return self.manager.hook

    def plugin_names(self) -> list[str]:
        """Names of the registered plugins, sorted."""
        return sorted(n for n, p in self.manager.list_name_plugin() if p is not None)

    def hooks_of(self, name: str) -> list[str]:
        """The hooks plugin ``name`` implements, sorted."""
        plugin = self.manager.get_plugin(name)
        if plugin is None:
            raise KeyError(f"no plugin named {name!r}; registered: {self.plugin_names()}")
        callers = self.manager.get_hookcallers(plugin) or []
        return sorted(c.name for c in callers)

    def _per_plugin(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every impl of a hook, returning ``(plugin name, result)`` sorted by name."""
        caller = getattr(self.manager.hook, hook_name)
        results: list[tuple[str, Any]] = []
        for impl in caller.get_hookimpls():
            result = impl.function(*(kwargs[arg] for arg in impl.argnames))
            results.append((impl.plugin_name, result))
        return sorted(results, key=lambda item: item[0])

    def _unique(self, hook_name: str, key: str, what: str) -> dict[str, tuple[str, Any]]:
        found: dict[str, tuple[str, Any]] = {}
        for plugin, items in self._per_plugin(hook_name):
            entries = items.items() if isinstance(items, dict) else ((getattr(item, key), item) for item in items or ())
            for name, item in entries:
                if name in found:
                    raise DuplicateNameError(
                        f"{what} {name!r} is offered by both plugin {found[name][0]!r} and "
                        f"plugin {plugin!r}; block one with {BLOCK_ENV}={plugin}"
                    )
                found[name] = (plugin, item)
        return found

    def backends(self) -> dict[str, BackendSpec]:
        """Every backend offered, keyed by name."""
        return {n: b for n, (_, b) in self._unique("writeback_backends", "name", "backend").items()}

    def runtime_delegates(self) -> dict[str, RuntimeDelegate]:
        """Every Python runtime delegate offered, keyed by backend id."""
        found = self._unique("writeback_runtime_delegates", "backend_id", "runtime delegate")
        return {n: d for n, (_, d) in found.items()}

    def engines(self) -> dict[str, AliasingEngine]:
        """Every aliasing engine offered (``writeback_engines``), keyed by name, in name order."""
        return {n: e for n, (_, e) in sorted(self._unique("writeback_engines", "name", "engine").items())}

    def runtimes(self) -> dict[str, RuntimeSpec]:
        """Every runtime offered (``writeback_runtimes``), keyed by name."""
        return {n: r for n, (_, r) in self._unique("writeback_runtimes", "name", "runtime").items()}

    def state_allocators(self) -> dict[str, StateAllocator]:
        """Every state allocator offered (``writeback_state_allocators``), keyed by backend name."""
        found = self._unique("writeback_state_allocators", "name", "state allocator for backend")
        return {n: a for n, (_, a) in found.items()}

    def models(self) -> dict[str, Any]:
        """Every model offered (built-in zoo included), keyed by name."""
        return {n: m for n, (_, m) in self._unique("writeback_models", "name", "model").items()}

    def program_passes(self, stage: Stage) -> list[ProgramPass]:
        """Every pass for ``stage``, ordered by ``(order, name)``."""
        passes = [p for _, ps in self._per_plugin("writeback_program_passes", stage=stage) for p in ps or ()]
        return sorted((p for p in passes if p.stage == stage), key=lambda p: (p.order, p.name))

    def decide_in_place(self, backend: str, partition: PartitionView, mutation: Mutation) -> InPlaceDecision:
        """Ask every plugin whether ``backend`` writes ``mutation`` in place, and decide.

        Raises :class:`InPlaceConflictError` naming both sides when plugins disagree.
        """
        answers = self._per_plugin(
            "writeback_accepts_in_place", backend=backend, partition=partition, mutation=mutation
        )
        accepted = tuple(p for p, a in answers if a is True)
        declined = tuple(p for p, a in answers if a is False)
        bad = [(p, a) for p, a in answers if a is not None and not isinstance(a, bool)]
        if bad:
            plugin, answer = bad[0]
            raise TypeError(
                f"plugin {plugin!r} answered writeback_accepts_in_place with {answer!r} for "
                f"{mutation.target!r}; the hook must return True, False or None"
            )
        if accepted and declined:
            raise InPlaceConflictError(
                f"plugins disagree whether backend {backend!r} writes {mutation.kind.value} "
                f"{mutation.target!r} ({mutation.write.describe()}) in place: "
                f"{', '.join(accepted)} say yes, {', '.join(declined)} say no; "
                f"block one of them with {BLOCK_ENV}"
            )
        return InPlaceDecision(
            backend=backend,
            target=mutation.target,
            placeholder=mutation.placeholder,
            write=mutation.write.kind.value,
            accepted=bool(accepted),
            accepted_by=accepted,
            declined_by=declined,
        )

    def annotate_in_place(
        self,
        graph: torch.fx.Graph,
        backend: str,
        partition: PartitionView,
        mutations: Iterable[Mutation],
    ) -> list[InPlaceDecision]:
        """Decide each mutation and record the decision on its placeholder in ``graph``.

        The record lives in ``node.meta["custom"]`` and so survives ``to_edge``,
        partitioning, lowering and ``to_executorch``. Every decision is made
        before any is recorded, so a conflict leaves the graph unchanged.
        """
        by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
        decisions = [self.decide_in_place(backend, partition, m) for m in mutations]
        for decision in decisions:
            node = by_name.get(decision.placeholder)
            if node is None:
                raise KeyError(
                    f"mutation of {decision.target!r} names placeholder "
                    f"{decision.placeholder!r}, which this graph does not have"
                )
            meta.set_custom(node, meta.IN_PLACE, decision.to_meta())
        return decisions


def in_place_decisions(program: ExportedProgram) -> dict[str, InPlaceDecision]:
    """The decisions recorded on ``program``'s placeholders, keyed by target."""
    found: dict[str, InPlaceDecision] = {}
    for node in program.graph_module.graph.nodes:
        if node.op == "placeholder":
            decision = InPlaceDecision.from_node(node)
            if decision is not None:
                found[decision.target] = decision
    return found


def load_registry(entry_points: bool = True, plugins: Sequence[object] = ()) -> Registry:
    """Build a registry: core's built-in plugin, entry points, then ``plugins``.

    :param entry_points: load plugins from the ``writeback`` entry-point group.
    :param plugins: extra plugin objects (a class instance or module); each is
        registered under its ``writeback_name`` attribute if it has one.
    :raises pluggy.PluginValidationError: a hookimpl matches no hookspec, or
        its signature does not fit the spec.
    """
    from writeback_core import default_plugin

    manager = pluggy.PluginManager(NAME)
    manager.add_hookspecs(hookspecs)
    blocked = {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}
    for name in blocked:
        manager.set_blocked(name)
    if os.environ.get(TRACE_ENV) == "1":
        manager.trace.root.setwriter(sys.stderr.write)
        manager.enable_tracing()
    if BUILTIN_NAME not in blocked:
        manager.register(default_plugin, name=BUILTIN_NAME)
    if entry_points:
        manager.load_setuptools_entrypoints(NAME)
    for plugin in plugins:
        label = _plugin_label(plugin)
        if label is not None and label in blocked:
            continue
        manager.register(plugin, name=label)
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as error:
        raise pluggy.PluginValidationError(
            error.plugin,
            f"{error}. Hook names must match a spec in writeback_core.hookspecs "
            "(run `writeback plugins` to list them).",
        ) from error
    return Registry(manager)
