"""Why each program pass runs where it does, in words: what ``explain`` and ``run`` print."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import get_args

from writeback_core.registry import Registry
from writeback_core.types import NO_BACKEND, ProgramPass, Stage

__all__ = ["listed", "passes_run_lines", "why_it_runs"]


def listed(names: Sequence[str]) -> str:
    """``a``; ``a and b``; ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def why_it_runs(plugin: str, program_pass: ProgramPass) -> list[str]:
    """What makes ``program_pass`` run where it does: its plugin, backends, relations and reason."""
    backends = program_pass.backends
    reasons = [f"plugin {plugin}", "every backend" if backends is None else f"for {listed(sorted(backends))}"]
    if program_pass.after:
        reasons.append(f"after {listed(program_pass.after)}")
    if program_pass.before:
        reasons.append(f"before {listed(program_pass.before)}")
    if program_pass.reason:
        reasons.append(program_pass.reason)
    return reasons


def passes_run_lines(registry: Registry, backend: str | None, ran: Sequence[str]) -> list[str]:
    """``program passes run for backend B:`` then one line per pass of ``ran`` (the names a
    lowering for ``backend`` ran, in order): the backends it serves and why it runs."""
    offered = {
        program_pass.name: program_pass
        for stage in get_args(Stage)
        for _, program_pass in registry.program_pass_offers(stage, backend)
    }
    head = f"program passes run for backend {backend if backend is not None else NO_BACKEND}"
    if not ran:
        return [f"{head}: none (no plugin registers one for it)"]
    lines = [f"{head}, with the backends each serves and why:"]
    width = max(map(len, ran))
    for name in ran:
        found = offered.get(name)
        if found is None:
            why = "no installed plugin offers it now"
        else:
            served = "every backend" if found.backends is None else ", ".join(sorted(found.backends))
            why = f"{served}: {found.reason}" if found.reason else served
        lines += textwrap.wrap(f"  {name:<{width}}  {why}", _WIDTH, subsequent_indent=" " * (width + 4))
    return lines


# run's console is 120 columns wide: a line wraps within it, under its pass.
_WIDTH = 118
