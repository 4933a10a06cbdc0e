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

# Programs the slow tier checks per run, over all chunks: 2,000 (the full differential
# fuzz), a budget that keeps the whole CI run well under 90 minutes on a 2-core machine
# (cost measured in test_fuzz_ci.py's docstring). WRITEBACK_FUZZ_PROGRAMS=400 for a
# shorter run.
CI_PROGRAMS = int(os.environ.get("WRITEBACK_FUZZ_PROGRAMS", "2000"))


@pytest.fixture
def fuzz_registry() -> Registry:
    """A fresh registry with exactly :data:`FUZZ_PLUGINS`."""
    import importlib

    return load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in FUZZ_PLUGINS])
