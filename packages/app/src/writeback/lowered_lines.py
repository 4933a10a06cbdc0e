"""The lines that describe a lowered program to its user, shared by ``writeback run`` and
``writeback export``: where each mutated state lives (:func:`state_lines`) and which runtime
loads the ``.pte`` (:func:`where_it_loads`)."""

from __future__ import annotations

from pathlib import Path

from writeback_core.lowered import StatePlace
from writeback_core.units import format_bytes

__all__ = ["place_text", "runner_loads", "state_lines", "where_it_loads"]

# Backends whose delegates the stock ExecuTorch runtime (and so its LLM runner) has linked in.
_STOCK_BACKENDS = frozenset({"portable", "xnnpack"})


def runner_loads(backend: str | None) -> bool:
    """Whether ExecuTorch's stock runtime, and so ``TextLLMRunner``, can load a program
    lowered for ``backend`` (``None``: no delegate)."""
    return backend is None or backend in _STOCK_BACKENDS


def where_it_loads(backend: str | None, pte_path: Path) -> str:
    """One line saying which runtime loads a program lowered for ``backend``, and how."""
    if runner_loads(backend):
        return (
            f"loads in ExecuTorch's stock runtime (executorch.runtime.Runtime.get().load_program('{pte_path}')) "
            "and its LLM runner"
        )
    return (
        f"needs writeback's runtime: writeback_pybind_runtime.Runtime.get().load_program('{pte_path}') with the "
        f"{backend} backend's package installed (writeback-pybind-runtime registers its delegate); ExecuTorch's "
        "stock runtime and TextLLMRunner fail to load it (backend not registered)"
    )


def place_text(place: StatePlace) -> str:
    """Where one state lives and whether a whole-state copy is left, in words:
    ``caller tensor, written in place by delegate 0 (mlx); no copy left``."""
    if place.owner == "delegate":
        where = f"inside delegate {place.delegate} ({place.backend})"
        if place.in_place:
            where += ", written in place"
    else:
        where = "caller tensor" if place.owner == "caller" else "program buffer"
        # A copy left means no delegate writes it in place, whatever a plugin accepted.
        if place.delegate is not None and not place.copy_bytes:
            where += f", written in place by delegate {place.delegate} ({place.backend})"
        elif place.in_place and place.writers and not place.copy_bytes:
            where += f", written in place by one of delegates {', '.join(map(str, place.writers))} ({place.backend})"
    if place.copy_bytes:
        why = f": {place.why}" if place.why else ""
        return f"{where}; whole-state copy left ({format_bytes(place.copy_bytes)}/call){why}"
    return f"{where}; no copy left"


# Past this many mutated states, run prints one line per kind of place instead of one per state.
_STATE_LINES = 8


def state_lines(places: list[StatePlace]) -> list[str]:
    """The lines ``run`` prints under its summary: one per state, or past
    :data:`_STATE_LINES` states one per kind of place (count, bytes, first and last name)."""
    if len(places) <= _STATE_LINES:
        return [f"  {p.mutation.target} ({format_bytes(p.mutation.nbytes)}): {place_text(p)}" for p in places]
    groups: dict[str, list[StatePlace]] = {}
    for place in places:
        groups.setdefault(place_text(place), []).append(place)
    lines = []
    for text, members in groups.items():
        total = sum(m.mutation.nbytes or 0 for m in members)
        names = members[0].mutation.target + (f" ... {members[-1].mutation.target}" if len(members) > 1 else "")
        count = f"{len(members)} state" + ("s" if len(members) != 1 else "")
        lines.append(f"  {count}, {format_bytes(total)} ({names}): {text}")
    return lines
