"""`writeback bench` works end to end on the two smallest sizes (not its speed: that is what
the command itself reports), and a pipeline that cannot run is reported, not dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import writeback_mlx_backend.plugin as mlx_plugin
import writeback_passes.plugin as passes_plugin
from click.testing import CliRunner
from rich.console import Console
from writeback.cli import main
from writeback_bench.cache_sizes import REINPLACE, WRITEBACK, run_bench, tables
from writeback_bench.contenders import STOCK, XNNPACK
from writeback_core.registry import load_registry

# Slow tier: runs with --slow (CI does); see tests/conftest.py.
pytestmark = pytest.mark.slow


def test_bench_two_smallest_sizes_one_repeat_prints_every_pipeline_and_writes_the_plot(tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(main, ["bench", "--sizes", "1,2", "--repeats", "1", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    for text in (
        "1 MiB",
        "2 MiB",
        STOCK,
        REINPLACE,
        XNNPACK,
        WRITEBACK,
        "eager (floor)",
        "slice copy_ (floor)",
        "stock / writeback",
        "stock+xnnpack / writeback",
        "writeback (xnnpack)",  # writeback's deployable path, unless --backend says otherwise
    ):
        assert text in result.output
    assert "goal" not in result.output  # it reports figures; it sets no threshold
    # Every pipeline lowered, ran and matched eager on its warm-up calls.
    assert "failed" not in result.output and "wrong" not in result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_reports_a_pipeline_that_cannot_be_assembled_instead_of_dropping_its_row() -> None:
    registry = load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin])  # no runtime plugin
    result = run_bench(registry, [1.0], repeats=1)
    (size,) = result.sizes
    error = size.error(WRITEBACK, "step")
    assert error is not None and "no writeback pipeline" in error
    for stock in (STOCK, XNNPACK):
        assert size.error(stock, "step") is None and size.median(stock, "step") is not None
    console = Console(record=True, width=200)
    for table in tables(result):
        console.print(table)
    rows = [line for line in console.export_text().splitlines() if line.startswith("│ ") and "MiB" in line]
    assert len(rows) == 2 and all("failed" in row for row in rows)
