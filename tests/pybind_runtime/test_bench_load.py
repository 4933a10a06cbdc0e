"""The load benchmark runs end to end (its timings are printed, never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from writeback_bench import pybind_load as bench_load

from tests.pybind_runtime.conftest import Lower
from tests.pybind_runtime.isolated_worker import EXAMPLE, StatefulMLP

# Slow tier: runs with --slow (CI does); see tests/conftest.py.
pytestmark = pytest.mark.slow


def test_bench_load_main_prints_both_runtimes_and_where_the_bytes_live(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_load.main(["--mib", "1", "--loads", "1"]) == 0
    out = capsys.readouterr().out
    assert "medians of 1 loads" in out
    assert bench_load.OURS in out and bench_load.STOCK in out
    assert "open(path).read() (reference)" in out
    stock_row = next(line for line in out.splitlines() if line.startswith(bench_load.STOCK))
    assert " 1.00x " in stock_row, out


def test_bench_load_xnnpack_holds_the_weights_once_after_load(capsys: pytest.CaptureFixture[str]) -> None:
    """A 192 MiB linear layer lowered to XNNPACK: once its method has loaded and run,
    writeback's runtime holds about one copy of the weights (XNNPACK's packed one;
    the weight mapped from the file while the method loaded is unmapped), as stock's
    mapped loading does. Reading the whole file in held two (+384 MiB)."""
    assert bench_load.main(["--mib", "192", "--xnnpack", "--loads", "1"]) == 0
    out = capsys.readouterr().out
    size = float(out.split(" MiB .pte")[0])
    anon = {}
    for line in out.splitlines():
        for name in (bench_load.OURS, bench_load.STOCK):
            if line.startswith(name):
                anon[name] = float(line.split("+")[1].split(" MiB anon")[0])
    assert len(anon) == 2, out
    assert anon[bench_load.OURS] <= 1.1 * size, out
    assert anon[bench_load.OURS] <= anon[bench_load.STOCK] + 0.1 * size, out


def test_bench_load_portable_maps_a_large_constant_instead_of_copying_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A 64 MiB constant of a portable program (read whole by the call): once loaded and
    run, writeback's runtime holds it in the page cache through its mapping of the file,
    not in memory of its own (reading it at load_program added +64 MiB anon), as stock's
    mapped loading does."""
    assert bench_load.main(["--mib", "64", "--loads", "1"]) == 0
    out = capsys.readouterr().out
    size = float(out.split(" MiB .pte")[0])
    row = next(line for line in out.splitlines() if line.startswith(bench_load.OURS))
    anon = float(row.split("+")[1].split(" MiB anon")[0])
    file_backed = float(row.split("+")[2].split(" MiB file-backed")[0])
    assert anon <= 0.1 * size, out
    assert file_backed >= 0.9 * size, out


def test_bench_load_pte_loads_the_file_given_without_running_it(
    lower: Lower, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mlp.pte"
    path.write_bytes(lower(StatefulMLP(), EXAMPLE, partitioners=[XnnpackPartitioner()]))
    assert bench_load.main(["--pte", str(path), "--loads", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path.stat().st_size / 2**20:.1f} MiB .pte (mlp.pte), medians of 2 loads"), out
    assert "resident after load" in out
    for name in (bench_load.OURS, bench_load.STOCK):
        row = next(line for line in out.splitlines() if line.startswith(name))
        assert row.split()[-7] == "-", row  # no first result
        assert "MiB anon" in row, row
