"""Shared pieces of the fuzz tests: the plugin set the CI fuzz runs with, and the CI budget.

The registry is built from named plugin modules (not entry points), so an
in-progress sibling plugin cannot change what CI fuzzes: the passes (early
write-back and its ``to_executorch`` step) and the pybind-runtime, and for the
engine targets the copy-back path (trt-copyback).
"""

from __future__ import annotations

import os

import pytest
from writeback_core.registry import Registry, load_registry

# The plugins every fuzz test lowers and runs with.
FUZZ_PLUGINS = ("writeback_passes.plugin", "writeback_pybind_runtime.plugin")

# The same, plus the copy-back path's plugin, whose engine (kv-alias) becomes two targets.
ENGINE_PLUGINS = (*FUZZ_PLUGINS, "writeback_trt_copyback.plugin")

# Programs the slow tier checks per run, over all chunks: a budget that keeps the whole
# of .ci/run under 45 minutes on a 2-core machine (~0.65 s per program and worker, plus
# the engine targets on every 4th). WRITEBACK_FUZZ_PROGRAMS=2000 runs the full
# 2,000-program differential fuzz (measured: 200 programs of chunk 0 take ~4.6 min).
CI_PROGRAMS = int(os.environ.get("WRITEBACK_FUZZ_PROGRAMS", "400"))


@pytest.fixture
def fuzz_registry() -> Registry:
    """A fresh registry with exactly :data:`FUZZ_PLUGINS`."""
    import importlib

    return load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in FUZZ_PLUGINS])
