"""The load benchmark runs end to end (its timings are printed, never asserted)."""

from __future__ import annotations

import pytest
from writeback_bench import pybind_load as bench_load

# Slow tier: runs with --slow (CI does); see tests/conftest.py.
pytestmark = pytest.mark.slow


def test_bench_load_main_prints_both_runtimes_and_where_the_bytes_live(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_load.main(["--mib", "1", "--loads", "1"]) == 0
    out = capsys.readouterr().out
    assert "medians of 1 loads" in out
    assert "writeback (file read as asked)" in out and "stock executorch.runtime (file mapped)" in out
    assert "open(path).read() (reference)" in out


def test_bench_load_xnnpack_holds_the_weights_once_after_load(capsys: pytest.CaptureFixture[str]) -> None:
    """A 192 MiB linear layer lowered to XNNPACK: once its method has loaded and run,
    writeback's runtime holds about one copy of the weights (XNNPACK's packed one;
    the blob read from the file is freed), as stock's mapped loading does. Reading
    the whole file in held two (+384 MiB)."""
    assert bench_load.main(["--mib", "192", "--xnnpack", "--loads", "1"]) == 0
    out = capsys.readouterr().out
    size = float(out.split(" MiB .pte")[0])
    anon = {}
    for line in out.splitlines():
        for name in ("writeback (file read as asked)", "stock executorch.runtime (file mapped)"):
            if line.startswith(name):
                anon[name] = float(line.split("+")[1].split(" MiB anon")[0])
    assert len(anon) == 2, out
    assert anon["writeback (file read as asked)"] <= 1.1 * size, out
    assert anon["writeback (file read as asked)"] <= anon["stock executorch.runtime (file mapped)"] + 0.1 * size, out
