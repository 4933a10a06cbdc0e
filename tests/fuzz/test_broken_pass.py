"""The fuzzer earns its keep: a deliberately broken rule patched into the early write-back
pass is caught within a CI-sized budget, and the failure is the rule's, not exir's."""

from __future__ import annotations

import importlib

import pytest
from writeback_core.registry import load_registry
from writeback_testing.fuzz import FuzzConfig, run_fuzz, summary
from writeback_testing.oracle import check_source
from writeback_testing.targets import StockTarget

from .conftest import FUZZ_PLUGINS

# Programs the fuzzer may take to find the broken rule (one in-process job, stock
# runtime only, no shrinking): a small fraction of CI's 2,000.
BUDGET = 300


def test_fuzzer_catches_early_write_back_that_ignores_readers_through_views(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule b of the pass, broken: a read of the state through a ``view_copy`` (which exir
    turns into a real view after the pass) no longer holds the write-back copy, so the
    copy can land before that read of the old value."""
    import writeback_passes.graph as graph  # the alias classes early write-back asks

    monkeypatch.setattr(graph, "_BECOMES_VIEW", frozenset())
    config = FuzzConfig(
        programs=BUDGET, seed=0, jobs=1, entry_points=False, plugins=FUZZ_PLUGINS, runtime="", shrink=False
    )
    report = run_fuzz(config)
    assert report.failures, f"broken rule not caught in {BUDGET} programs: {summary(report)}"
    (failure,) = report.failures
    assert failure.kind == "mismatch", failure.message
    assert "right without writeback's passes: a writeback bug" in failure.message
    assert failure.source is not None and ".view(-1)" in failure.source
    # With the real rule back, the same reproducer passes: the broken rule was the cause.
    monkeypatch.undo()
    registry = load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in FUZZ_PLUGINS])
    check_source(failure.source, [StockTarget()], registry)
