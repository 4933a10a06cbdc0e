"""The order of a stage's program passes, from what each pass says by name.

A :class:`~writeback_core.types.ProgramPass` says which passes of its stage it runs
``after`` and ``before``, and for which ``backends``. :func:`order_passes`:

1. refuses two passes of one stage with one name (relations would not know which);
2. refuses an ``after``/``before`` name no offered pass of the stage has, naming the pass
   and its plugin, unless the pass lists it in ``optional`` (its plugin may not be installed);
   links ``a`` before ``b`` for every ``b.after`` naming ``a`` and every ``a.before``
   naming ``b``;
3. refuses a cycle among all the stage's passes, whatever the backend, naming each
   pass in it and the plugin that offered it;
4. keeps the passes that run for the backend, with every relation between two of them
   that holds through the others (``a`` before ``x`` before ``b`` keeps ``a`` before ``b``
   when ``x`` runs for another backend only);
5. orders those topologically, taking among the passes free to run the one whose name
   sorts first, so that registration order never changes the result.

Example it must refuse: ``a`` with ``after=("b",)`` and ``b`` with ``after=("a",)``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

from writeback_core.types import ProgramPass, Stage

__all__ = ["PassOrderError", "order_passes"]


class PassOrderError(ValueError):
    """The passes of a stage cannot be ordered: their relations form a cycle, or two have one name."""


def order_passes(
    stage: Stage, offers: Iterable[tuple[str, ProgramPass]], backend: str | None
) -> list[tuple[str, ProgramPass]]:
    """The ``(plugin, pass)`` offers of ``stage`` that run for ``backend``, in run order.

    :param offers: each pass with the name of the plugin that offered it; passes of
        other stages are left out.
    :param backend: a ``BackendSpec.name``; ``None`` for a lowering with no backend.
    :raises PassOrderError: two offered passes of ``stage`` share a name, a relation names
        a pass none offers and is not ``optional``, or the stage's relations form a cycle
        (the message names each pass and its plugin).
    """
    offered: dict[str, tuple[str, ProgramPass]] = {}
    for plugin, program_pass in offers:
        if program_pass.stage != stage:
            continue
        seen = offered.get(program_pass.name)
        if seen is not None:
            raise PassOrderError(
                f"program pass {program_pass.name!r} of stage {stage!r} is offered by both plugin {seen[0]!r} "
                f"and plugin {plugin!r}; passes are ordered by name, so a name is offered once: "
                "rename one, or block one of the plugins"
            )
        offered[program_pass.name] = (plugin, program_pass)
    _refuse_unknown(stage, offered)
    successors = _successors(offered)
    _refuse_cycle(stage, offered, successors)
    running = {name for name, (_, p) in offered.items() if p.runs_for(backend)}
    kept = {name: _reachable(name, successors) & running for name in running}
    return [offered[name] for name in _topological(kept)]


def _refuse_unknown(stage: Stage, offered: Mapping[str, tuple[str, ProgramPass]]) -> None:
    """Raise :class:`PassOrderError` for the first ``after``/``before`` name no offered pass
    has that its pass does not mark ``optional``."""
    for name, (plugin, program_pass) in offered.items():
        for relation, names in (("after", program_pass.after), ("before", program_pass.before)):
            unknown = [n for n in names if n not in offered and n not in program_pass.optional]
            if unknown:
                raise PassOrderError(
                    f"program pass {name!r} of plugin {plugin!r} runs {relation} {unknown[0]!r}, but no installed "
                    f"plugin offers a pass of that name at stage {stage!r} (offered there: "
                    f"{', '.join(sorted(offered))}). Fix the name, or, when that pass belongs to a plugin "
                    f"that may not be installed, add it to the pass's optional=("
                    f"{unknown[0]!r},)"
                )


def _successors(offered: Mapping[str, tuple[str, ProgramPass]]) -> dict[str, set[str]]:
    """For each pass, the passes that must run after it (names of no offered pass dropped)."""
    successors: dict[str, set[str]] = {name: set() for name in offered}
    for name, (_, program_pass) in offered.items():
        successors[name].update(later for later in program_pass.before if later in offered)
        for earlier in program_pass.after:
            if earlier in offered:
                successors[earlier].add(name)
    return successors


def _reachable(start: str, successors: Mapping[str, set[str]]) -> set[str]:
    """Every pass that must run after ``start``, directly or through others."""
    found: set[str] = set()
    pending = list(successors[start])
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending.extend(successors[name])
    return found


def _topological(successors: Mapping[str, set[str]]) -> list[str]:
    """Kahn's algorithm, the free pass whose name sorts first taken first; passes in a
    cycle are left out (the caller refuses those first)."""
    waiting = dict.fromkeys(successors, 0)
    for names in successors.values():
        for name in names:
            waiting[name] += 1
    free = [name for name, count in waiting.items() if count == 0]
    heapq.heapify(free)
    ordered = []
    while free:
        name = heapq.heappop(free)
        ordered.append(name)
        for later in successors[name]:
            waiting[later] -= 1
            if waiting[later] == 0:
                heapq.heappush(free, later)
    return ordered


def _refuse_cycle(
    stage: Stage, offered: Mapping[str, tuple[str, ProgramPass]], successors: Mapping[str, set[str]]
) -> None:
    """Raise :class:`PassOrderError` naming one cycle, if the relations hold any."""
    stuck = set(offered) - set(_topological(successors))
    if not stuck:
        return
    # Every pass left waits for another one left: walking back from one must come round.
    predecessors = {name: sorted(e for e in stuck if name in successors[e]) for name in stuck}
    walk = [min(stuck)]
    while walk[-1] not in walk[:-1]:
        walk.append(predecessors[walk[-1]][0])
    cycle = list(reversed(walk[walk.index(walk[-1]) :]))
    raise PassOrderError(
        f"the program passes of stage {stage!r} cannot be ordered: their after=/before= relations form "
        f"a cycle: {_described(cycle, offered)}. Drop one of these relations, or block one of the plugins"
    )


def _described(cycle: Sequence[str], offered: Mapping[str, tuple[str, ProgramPass]]) -> str:
    """``'a' (plugin 'x') must run before 'b' (plugin 'y'), which must run before 'a'``."""
    named = [f"{name!r} (plugin {offered[name][0]!r})" for name in cycle[:-1]]
    joined = " must run before ".join(named[:1] + [f"{n}, which" for n in named[1:]])
    return f"{joined} must run before {cycle[-1]!r}"
