"""The load benchmark runs end to end (its timings are printed, never asserted)."""

from __future__ import annotations

import pytest
from writeback_pybind_runtime import bench_load

# Slow tier: runs with --slow (CI does); see tests/conftest.py.
pytestmark = pytest.mark.slow


def test_bench_load_main_prints_both_runtimes_and_where_the_bytes_live(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_load.main(["--mib", "1", "--loads", "1"]) == 0
    out = capsys.readouterr().out
    assert "medians of 1 loads" in out
    assert "writeback (file read in)" in out and "stock executorch.runtime (file mapped)" in out
    assert "open(path).read() (reference)" in out
