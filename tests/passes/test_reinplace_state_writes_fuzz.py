"""Generated stateful programs (writeback-testing's generator) through ``--backend portable`` and
``--backend xnnpack``: the contract check (each in-place answer against the lowered program) and
every run against eager PyTorch, in writeback's runtime and in stock ``executorch.runtime``."""

from __future__ import annotations

import os

import pytest
from writeback_testing.fuzz import FuzzConfig, run_fuzz, summary

PROGRAMS = int(os.environ.get("WRITEBACK_KERNEL_FUZZ_PROGRAMS", "6"))


@pytest.mark.slow  # lowers each program three times per backend and runs it in two runtimes
def test_generated_programs_through_portable_and_xnnpack_match_eager() -> None:
    config = FuzzConfig(programs=PROGRAMS, seed=15, backends=("portable", "xnnpack"), engines=())
    report = run_fuzz(config)
    assert not report.failures, "\n\n".join(f.message for f in report.failures[:2])
    checked = {name: count for name, count in report.targets.items() if name.startswith(("portable", "xnnpack"))}
    assert checked.get("portable-stock", 0) > 0 and checked.get("xnnpack-stock", 0) > 0, summary(report)
