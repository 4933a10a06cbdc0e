"""The plugin registry: one pluggy ``PluginManager`` per :class:`Registry`, never a global.

``load_registry`` builds one; nothing is loaded at import time, and this module
imports no part of the application (CLI, pipeline, zoo): the application's commands
and models are its plugin ``writeback`` (the project's name), an entry point like any other.

A plugin has one name, its entry point's (the name ``writeback plugins`` lists);
a plugin object whose ``writeback_name`` says otherwise is an error. Every hook
is called through pluggy's hook callers, so tracing sees every call.

Environment:

- ``WRITEBACK_LOAD_PLUGINS``: comma-separated entry-point names; when set, only
  those entry points and the application's ``writeback`` are loaded (set but empty:
  the application alone). A name no installed plugin has is an error that lists the
  installed ones.
- ``WRITEBACK_BLOCK_PLUGINS``: comma-separated plugin names that are never loaded,
  whether entry points or plugins handed to ``load_registry``; it wins over the
  allow-list. A name no plugin has is warned about.
- ``WRITEBACK_TRACE_PLUGINS``: when set to ``1``, every hook call is traced to stderr.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy
import torch.fx
from torch.export import ExportedProgram

from writeback_core import hookspecs, meta
from writeback_core._name import NAME
from writeback_core.mutations import Mutation
from writeback_core.pass_order import PassOrderError, order_passes
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
    "BUILTIN_NAME",
    "LOAD_ENV",
    "TRACE_ENV",
    "InPlaceConflictError",
    "InPlaceDecision",
    "PassOrderError",
    "PluginNameError",
    "Registry",
    "hookimpl",
    "load_registry",
]

hookimpl = pluggy.HookimplMarker(NAME)

BLOCK_ENV = "WRITEBACK_BLOCK_PLUGINS"
LOAD_ENV = "WRITEBACK_LOAD_PLUGINS"
TRACE_ENV = "WRITEBACK_TRACE_PLUGINS"
# The entry-point name of the application's plugin (built-in models, the CLI's commands):
# the project's name, whichever distribution ships it.
BUILTIN_NAME = NAME


class InPlaceConflictError(ValueError):
    """Two plugins answered the per-mutation hook differently for one mutation."""


class DuplicateNameError(ValueError):
    """Two plugins offered the same backend, delegate or model name."""


class PluginNameError(ValueError):
    """A plugin has two names, or an environment variable names no installed plugin."""


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
        """Call a hook once per implementing plugin: ``(plugin name, answer)``, sorted by name.

        Each call goes through a pluggy hook caller narrowed to that plugin (and
        every hook wrapper), so tracing and wrappers see it as any hook call. A
        plugin that returned ``None`` answers ``None`` (pluggy's list drops it).
        """
        impls = getattr(self.manager.hook, hook_name).get_hookimpls()
        answering = [impl for impl in impls if not (impl.hookwrapper or impl.wrapper)]
        results: list[tuple[str, Any]] = []
        for impl in answering:
            others = [other.plugin for other in answering if other is not impl]
            answer = self.manager.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)
            results.append((impl.plugin_name, answer[0] if answer else None))
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

    def model_from_path(self, path: str, accept_weights: bool = False) -> Any:
        """The :class:`~writeback_core.types.ModelCase` a plugin reads from ``path``
        (``writeback_model_from_path``, passed ``accept_weights``), or ``None`` when no
        plugin recognizes it.

        :raises DuplicateNameError: two plugins recognize the path (naming both).
        """
        answers = self._per_plugin("writeback_model_from_path", path=path, accept_weights=accept_weights)
        found = [(plugin, case) for plugin, case in answers if case]
        if len(found) > 1:
            raise DuplicateNameError(
                f"path {path!r} is read as a model by both plugin {found[0][0]!r} and plugin {found[1][0]!r}; "
                f"block one with {BLOCK_ENV}={found[1][0]}"
            )
        return found[0][1] if found else None

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

    def program_passes(self, stage: Stage, backend: str | None) -> list[ProgramPass]:
        """The passes of ``stage`` a lowering for ``backend`` runs, in the order they run.

        :param backend: a ``BackendSpec.name``; ``None`` for a lowering with no backend.
        :raises PassOrderError: see :meth:`program_pass_offers`.
        """
        return [p for _, p in self.program_pass_offers(stage, backend)]

    def program_pass_offers(self, stage: Stage, backend: str | None) -> list[tuple[str, ProgramPass]]:
        """:meth:`program_passes` with the name of the plugin that offers each:
        every pass the plugins offer for ``stage`` whose ``backends`` admit ``backend``,
        ordered by their ``after``/``before`` relations, ties broken by name
        (:func:`~writeback_core.pass_order.order_passes`).

        :raises PassOrderError: the stage's relations form a cycle, or two plugins offer
            a pass of one name (the message names the passes and their plugins).
        """
        offers = self._per_plugin("writeback_program_passes", stage=stage)
        return order_passes(stage, [(plugin, p) for plugin, ps in offers for p in ps or ()], backend)

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


def _names(variable: str) -> list[str] | None:
    """The comma-separated names in environment ``variable``; ``None`` when it is unset."""
    value = os.environ.get(variable)
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _distribution(point: metadata.EntryPoint) -> str:
    dist = getattr(point, "dist", None)
    return "an unknown distribution" if dist is None else f"distribution {dist.name}"


def _installed() -> dict[str, metadata.EntryPoint]:
    """The ``writeback`` entry points, keyed by name (the plugins' names)."""
    found: dict[str, metadata.EntryPoint] = {}
    for point in metadata.entry_points(group=NAME):
        seen = found.get(point.name)
        if seen is not None and seen.value != point.value:
            raise PluginNameError(
                f"two installed plugins are called {point.name!r}: {seen.value} ({_distribution(seen)}) "
                f"and {point.value} ({_distribution(point)}); uninstall one of them"
            )
        found[point.name] = point
    return found


def _own_name(plugin: object) -> str | None:
    name = getattr(plugin, "writeback_name", None)
    return name if isinstance(name, str) else None


def _register(manager: pluggy.PluginManager, plugin: object, name: str | None) -> None:
    """Register ``plugin`` under ``name`` (an entry point's), or under its own ``writeback_name``."""
    own = _own_name(plugin)
    if name is not None and own is not None and own != name:
        raise PluginNameError(
            f"plugin {name!r} (entry point {name} in group {NAME!r}) calls itself {own!r} "
            f"(writeback_name = {own!r}); a plugin has one name, its entry point's: "
            f"set writeback_name = {name!r} or rename the entry point to {own!r}"
        )
    try:
        manager.register(plugin, name=name if name is not None else own)
    except ValueError as error:
        raise PluginNameError(
            f"{error}. A plugin is registered once, under one name: do not also pass an "
            "installed plugin in plugins= (load_registry(entry_points=False, plugins=...) "
            f"takes only the given ones), and give each plugin its own writeback_name"
        ) from error


def _check_env_names(installed: dict[str, metadata.EntryPoint], given: Iterable[str | None]) -> None:
    """Refuse an allow-list naming no installed plugin; warn about a block list that blocks nothing."""
    available = ", ".join(sorted(installed))
    unknown = sorted(set(_names(LOAD_ENV) or ()) - set(installed))
    if unknown:
        raise PluginNameError(
            f"{LOAD_ENV} names {', '.join(map(repr, unknown))}, which no installed plugin is "
            f"called; installed plugins: {available}. Use the names `{NAME} plugins` lists."
        )
    known = set(installed) | {name for name in given if name is not None}
    stray = sorted(set(_names(BLOCK_ENV) or ()) - known)
    if stray:
        warnings.warn(
            f"{BLOCK_ENV} names {', '.join(map(repr, stray))}, which no plugin is called, so it "
            f"blocks nothing; installed plugins: {available}. Use the names `{NAME} plugins` lists.",
            stacklevel=3,
        )


def load_registry(entry_points: bool = True, plugins: Sequence[object] = ()) -> Registry:
    """Build a registry: the installed plugins (core's built-in among them), then ``plugins``.

    :param entry_points: load the plugins of the ``writeback`` entry-point group,
        each under its entry-point name, as ``WRITEBACK_LOAD_PLUGINS`` and
        ``WRITEBACK_BLOCK_PLUGINS`` allow. Without them only ``plugins`` are
        registered; pass ``writeback.default_plugin`` there to have core's
        built-in models and commands.
    :param plugins: extra plugin objects (a class instance or module); each is
        registered under its ``writeback_name`` attribute if it has one, unless
        ``WRITEBACK_BLOCK_PLUGINS`` names it.
    :raises PluginNameError: an entry-point plugin's ``writeback_name`` is not its
        entry-point name, one plugin is registered twice, or
        ``WRITEBACK_LOAD_PLUGINS`` names a plugin that is not installed.
    :raises pluggy.PluginValidationError: a hookimpl matches no hookspec, or
        its signature does not fit the spec.
    """
    installed = _installed()
    labels = [_own_name(plugin) for plugin in plugins]
    _check_env_names(installed, labels)
    blocked = set(_names(BLOCK_ENV) or ())
    allowed = _names(LOAD_ENV)
    manager = pluggy.PluginManager(NAME)
    manager.add_hookspecs(hookspecs)
    for name in blocked:
        manager.set_blocked(name)
    if os.environ.get(TRACE_ENV) == "1":
        manager.trace.root.setwriter(sys.stderr.write)
        manager.enable_tracing()
    if entry_points:
        wanted = set(installed) if allowed is None else {*allowed, BUILTIN_NAME}
        for name in sorted(wanted & set(installed) - blocked):
            _register(manager, installed[name].load(), name)
    for plugin, label in zip(plugins, labels, strict=True):
        if label is None or label not in blocked:
            _register(manager, plugin, None)
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as error:
        raise pluggy.PluginValidationError(
            error.plugin,
            f"{error}. Hook names must match a spec in writeback_core.hookspecs "
            "(run `writeback plugins` to list them).",
        ) from error
    return Registry(manager)
