"""Engine targets in the fuzz loop: every engine the registry offers, reached through hooks;
a program an engine refuses is reported as skipped with its reason and counted, never passed."""

from __future__ import annotations

from click.testing import CliRunner
from writeback.cli import main
from writeback_testing.fuzz import FuzzConfig, run_fuzz, summary

from .conftest import FUZZ_PLUGINS
from .refusing_engine import REASON

REFUSING = (*FUZZ_PLUGINS, "tests.fuzz.refusing_engine")


def test_program_an_engine_refuses_through_writeback_lower_for_engine_is_counted_as_skipped() -> None:
    config = FuzzConfig(
        programs=3, seed=5, jobs=1, entry_points=False, plugins=REFUSING, runtime_every=1000, shrink=False
    )
    report = run_fuzz(config)
    lines = "\n".join(summary(report))
    assert not report.failures, lines
    assert report.programs == 3
    assert report.target_skips == {("refusing-pybind", "unsupported"): 3, ("refusing-stock", "unsupported"): 3}
    assert "refusing-pybind" not in report.targets and "refusing-stock" not in report.targets
    assert "refusing-pybind x3" in lines and REASON.split(":")[0] in lines


def test_engines_need_a_runtime_and_the_summary_says_so() -> None:
    config = FuzzConfig(programs=1, seed=5, jobs=1, entry_points=False, plugins=REFUSING, runtime="", shrink=False)
    report = run_fuzz(config)
    assert report.programs == 1 and not report.target_skips
    assert any("engine targets not run" in line for line in summary(report))


def test_fuzz_command_selects_engines_and_refuses_contradictory_flags() -> None:
    result = CliRunner().invoke(main, ["fuzz", "--programs", "1", "--jobs", "1", "--engine", "x", "--no-engines"])
    assert result.exit_code == 2 and "--no-engines" in result.output
    result = CliRunner().invoke(
        main,
        [
            "fuzz",
            "--programs",
            "1",
            "--seed",
            "5",
            "--jobs",
            "1",
            "--runtime-every",
            "1000",
            "--engine",
            "no-such-engine",
        ],
    )
    assert result.exit_code == 2 and "no plugin offers engine(s) 'no-such-engine'; offered: kv-alias" in result.output
