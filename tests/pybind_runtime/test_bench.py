"""The benchmark command runs end to end (its timings are printed, never asserted)."""

from __future__ import annotations

import pytest
from writeback_bench import pybind as bench

# Slow tier: runs with --slow (CI does); see tests/conftest.py.
pytestmark = pytest.mark.slow


def test_bench_main_prints_both_cases_and_checks_no_cache_copy(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--calls", "2", "--cache-mib", "0.0625"]) == 0
    out = capsys.readouterr().out
    assert "mlp (no mutation)" in out and "decoder-caller-cache" in out
    assert "alias the caller's tensors (no copy): True" in out
    assert "stock (cache copied in, not updated)" in out and "caller cache updated: False" in out
    assert "writeback planned (copied back)" in out and "caller cache updated: True" in out
