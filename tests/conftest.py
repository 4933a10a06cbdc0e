"""Test tiers.

``uv run pytest`` runs the fast tier: every package's behaviour, in minutes. Tests
marked ``slow`` (long fuzz runs, the CI fuzz budget, benchmark smoke tests) run
only with ``--slow``, which ``.ci/run`` passes; ``WRITEBACK_FUZZ_PROGRAMS`` sets the
CI fuzz budget (see the README).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# pytest's own fixture for testing pytest plugins (writeback-testing's contract plugin).
pytest_plugins = ["pytester"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (long fuzz runs, benchmark smoke tests), as CI does",
    )


# Where the run's longest tests go under ``--dist worksteal`` (pyproject.toml), which hands
# each worker a contiguous half of the collection and lets an idle worker steal the tail of
# the other's queue. Modules whose tests run one long process each go first: they start
# early and the other worker takes the cheap tail. The CI fuzz chunks go last: each spreads
# its programs over both cores itself, so whichever runs last alone still keeps both busy.
_FIRST = ("tests/decoders/test_hf_states.py", "tests/decoders/test_et_hybrid.py", "tests/e2e/test_hostile_calls.py")
_LAST = ("tests/fuzz/test_fuzz_ci.py",)


def _place(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return 0 if path in _FIRST else 2 if path in _LAST else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--slow"):
        kept = [item for item in items if item.get_closest_marker("slow") is None]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("slow") is not None])
            items[:] = kept
    items.sort(key=_place)  # stable: each module's tests keep their order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection made (torch, exir and every test module's objects, alive for the
    whole run) out of the collector's reach: each later full collection then scans only what
    the tests make. About 13% of a lowering-heavy test file's time here (measurement log,
    2026-12-05, seventh session); objects made by a test are collected as before.

    And torch's set of composite ops, which every decomposition asks for twice, is made once per
    op registry instead (writeback_testing.cia_ops: the same set; measurement log, 2026-12-07)."""
    from writeback_testing.cia_ops import remember_cia_ops

    remember_cia_ops()
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class Decomposition:
    """One ``ExportedProgram.run_decompositions`` call: the size of the graph decomposed,
    whether a decomposition table was given (exir's ``to_edge``; none: core ATen, as
    ``writeback_core.program_passes.decomposed`` asks) and the module that called it."""

    nodes: int
    table: bool
    caller: str


@pytest.fixture
def decompositions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Decomposition]]:
    """Every decomposition of an exported program while the test runs, in order (the costly
    step of a lowering or of ``writeback explain`` at real size); the real one runs."""
    from torch.export import ExportedProgram

    seen: list[Decomposition] = []
    original = ExportedProgram.run_decompositions

    def counted(self: ExportedProgram, *args: Any, **kwargs: Any) -> ExportedProgram:
        caller = sys._getframe(1).f_globals.get("__name__", "?")
        seen.append(Decomposition(len(self.graph.nodes), bool(args or kwargs), caller))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ExportedProgram, "run_decompositions", counted)
    yield seen


def explain_cells(output: str) -> dict[str, list[str]]:
    """The cells of ``writeback explain``'s table laid out with a column per state: row label
    -> one text per state, a cell wrapped over several lines joined with spaces."""
    cells: dict[str, list[str]] = {}
    label = ""
    for line in output.splitlines():
        if not line.startswith("│"):
            continue
        parts = [p.strip() for p in line.strip("│").split("│")]
        if parts[0]:  # a row's first line; a wrapped cell goes on in the lines below
            label = parts[0]
            cells[label] = parts[1:]
        elif label:
            cells[label] = [f"{a} {b}".strip() for a, b in zip(cells[label], parts[1:], strict=True)]
    return cells
