"""writeback-bench's harnesses: apart from the packages they measure, and runnable as its
README says (their timings are printed, never asserted)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[2]
# The packages whose code the benchmarks measure: the application's `writeback bench` commands
# come from writeback-bench's plugin too.
MEASURED = ("app", "mlx-backend", "passes", "pybind-runtime", "trt-copyback")


@pytest.mark.parametrize("package", MEASURED)
def test_no_measured_package_ships_a_benchmark(package: str) -> None:
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "packages" / package / "src").rglob("*bench*"))
    assert modules == [], f"benchmarks live in writeback-bench, not beside the code they measure: {modules}"


def test_the_trt_harness_times_aliased_against_copy_back_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """No GPU and no Torch-TensorRT: it runs the TensorRT rule on the kv-alias engine."""
    from writeback_bench import trt

    trt.main(["--mib", "1", "--steps", "3"])
    out = capsys.readouterr().out
    assert "median of 2 interleaved steps" in out
    header, row = out.splitlines()[-2:]
    assert header.split() == ["cache", "aliased", "ms", "copy-back", "ms", "copy-back/aliased"]
    assert row.split()[:2] == ["1", "MiB"] and row.endswith("x")


@pytest.mark.slow
def test_the_memory_harness_lowers_every_built_in_model_both_ways_and_lets_no_warning_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import warnings

    from writeback.zoo import builtin_models
    from writeback_bench import passes_memory

    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        assert passes_memory.main(["--size", "16"]) == 0
    # What Python shows a user by default: not the deprecations it hides outside __main__.
    hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
    assert [f"{w.category.__name__}: {w.message}" for w in escaped if not issubclass(w.category, hidden)] == []
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {*builtin_models(), "early-ready"}
    stock, early, saved, state, _ = rows["early-ready"]
    assert int(state) == 16 * 16 * 4  # one [16, 16] fp32 state
    assert int(saved) >= int(state) and int(early) == int(stock) - int(saved)


def _commands(env: dict[str, str]) -> list[str]:
    """The subcommands ``writeback --help`` lists in a fresh process with ``env`` added."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "writeback", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    listing = done.stdout.split("Commands:")[1]
    return [line.split()[0] for line in listing.splitlines() if line.startswith("  ") and line.split()]


def test_the_bench_commands_come_from_writeback_bench_and_go_when_its_plugin_is_blocked() -> None:
    """The application alone has no `bench`: writeback-bench's plugin adds all three, and
    blocking it (as a user without the package has it) leaves the application's own commands."""
    from writeback_bench import plugin

    bench = {"bench", "bench-generate", "bench-scale"}
    # Each command is the bench package's own object, added by its plugin's hook.
    group = click.Group()
    plugin.writeback_cli_commands(group)
    assert sorted(group.commands) == sorted(bench)
    assert all(c.callback.__module__.startswith("writeback_bench.") for c in group.commands.values())

    assert bench <= set(_commands({}))
    alone = _commands({"WRITEBACK_BLOCK_PLUGINS": "writeback-bench"})
    assert not bench & set(alone), alone
    assert {"run", "export", "generate", "explain", "plugins"} <= set(alone)
