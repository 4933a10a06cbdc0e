"""The engine targets earn their keep: a copy-back path that skips a copy-back (the bug the
Torch-TensorRT thread fixed) is caught by the fuzzer within a few programs, and the
reproducer passes once the real path is back."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from writeback_core.registry import load_registry
from writeback_testing.engines import engine_targets
from writeback_testing.fuzz import FuzzConfig, run_fuzz, summary
from writeback_testing.oracle import check_source
from writeback_testing.targets import registry_runtime

from .conftest import ENGINE_PLUGINS

# Programs the fuzzer may take (one in-process job, stock and engine targets, no shrinking).
BUDGET = 20


@pytest.mark.slow
def test_fuzzer_catches_an_engine_path_that_skips_a_copy_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: every buffer write is filed engine-aliased, so a write the engine
    does not alias gets no copy-back (its write-back erased, the write left to dead code),
    and the cross-check that would refuse such a program is switched off."""
    import writeback_trt_copyback.compile as compile_module
    import writeback_trt_copyback.lift as lift
    from writeback_trt_copyback.crosscheck import engine_aliasing

    classify = lift._classify

    def everything_aliased(*args: object) -> object:
        cls, _ = classify(*args)  # type: ignore[arg-type]
        return dataclasses.replace(cls, aliased=True, reason=None, marked=False), None

    monkeypatch.setattr(lift, "_classify", everything_aliased)
    monkeypatch.setattr(
        compile_module, "check_aliasing", lambda program, engine, engines_built=True: engine_aliasing(program, engine)
    )
    config = FuzzConfig(
        programs=BUDGET, seed=0, jobs=1, entry_points=False, plugins=ENGINE_PLUGINS, runtime_every=1000, shrink=False
    )
    report = run_fuzz(config)
    assert report.failures, f"skipped copy-back not caught in {BUDGET} programs: {summary(report)}"
    (failure,) = report.failures
    assert failure.kind == "mismatch" and failure.target is not None, failure.message
    assert failure.target.startswith("kv-alias-"), failure.message
    assert failure.source is not None
    # With the real path back, the same reproducer passes every target of the engine.
    monkeypatch.undo()
    registry = load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in ENGINE_PLUGINS])
    report_back = check_source(failure.source, engine_targets(registry, registry_runtime(registry)), registry)
    assert report_back.targets == ["kv-alias-pybind", "kv-alias-stock"]
