"""CI's differential fuzz run: ``CI_PROGRAMS`` generated programs (2,000 by default; set
``WRITEBACK_FUZZ_PROGRAMS`` for another count), zero mismatches. Slow tier.

The programs are split in chunks, each its own hypothesis loop (own seed) in
worker processes, one per core (at most two). Every program runs through
stock ``executorch.runtime`` and, ``RUNTIME_EVERY`` being 1, through the
pybind-runtime too (planned, unplanned, unplanned with bound outputs). A
failure prints the shrunk program as a complete module.

Cost of the pybind variants, measured 2026-11-29 on the shared 2-core machine
(load 1.0-2.7), one worker, the same 60 programs each way in interleaved
rounds of 10, warm-up excluded: 0.64 s median / 0.65 s mean per program with
all four targets, 0.62 s / 0.62 s with stock only (+~5%: a program's cost is
its lowering, and the unplanned ``.pte`` is the only extra one). With two
workers on the loaded machine, 100 programs took 93 s and 104 s with every
program through the pybind variants, 110 s and 85 s with every 4th (the
difference is within the load's noise). Projected for 2,000 programs through
all targets: ~11 min on two idle cores (2,000 x 0.65 s / 2), ~31-35 min at
that load; against every 4th, ~1 min more CPU, on a fuzz part that fit in the
last whole CI run (~18.5 min). Inside the ~40 min budget: no split.

Every ``ENGINE_EVERY``-th program also takes the copy-back path of the kv-alias
engine (trt-copyback, reached through ``writeback_lower_for_engine``), run in the
pybind-runtime and in stock ``executorch.runtime``. Measured 2026-11-29, one
worker, load ~1.9, the same 30 programs (seed 31) each way: 0.64 s per program
without the engine targets, 1.58 s with them on every program (+0.94 s: the
engine's own export, lift, lowering and ``.pte``). Every 4th program: 500 per
run, ~+470 s of CPU, ~+4 min on two idle cores.

The generator since draws boundary and out-of-range run-time indices, index assignment,
slice bounds past either end, rolling buffers, convolutions and (about one program in 50)
a PT2E-quantized linear. Measured 2026-12-03 on the shared 2-core machine at load 4-5
(three other jobs), one worker, 40 programs (seed 31), every target as CI runs them
(pybind variants on all, engine targets on every 4th), no shrinking: 69.4 s of CPU with
the new draws, 68.6 s with them off (index_modes=False, quantized_chance=0, the old ten
write forms): the same cost, ~1.5 s of CPU per program at that load (start-up of ~10 s
included), ~0.65 s on an idle core as above. Lowering dominates (to_edge's two
run_decompositions ~75%, three to_executorch ~20%); the pybind variants already share the
stock target's "planned" lowering. So 2,000 programs: ~15 min on two idle cores
(2,000 x 0.65 s / 2, plus ~4 min of engine targets), ~25 min at that load; the whole CI
(~21 min with 400) then takes ~33-45 min, inside the 90-minute budget.
"""

from __future__ import annotations

import pytest
from writeback_testing.fuzz import FuzzConfig, default_jobs, run_fuzz, summary

from .conftest import CI_PROGRAMS, ENGINE_PLUGINS

# Slow tier: runs with --slow (CI does); see tests/conftest.py.
pytestmark = pytest.mark.slow

CHUNKS = 4
# Every program through the pybind variants too (cost measured in the docstring).
RUNTIME_EVERY = 1
# The copy-back engine targets on every 4th program (cost in the docstring).
ENGINE_EVERY = 4


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_generated_programs_match_eager_in_every_runtime(chunk: int) -> None:
    programs = CI_PROGRAMS // CHUNKS + (1 if chunk < CI_PROGRAMS % CHUNKS else 0)
    config = FuzzConfig(
        programs=programs,
        seed=1000 * chunk,
        jobs=default_jobs(),
        entry_points=False,
        plugins=ENGINE_PLUGINS,
        runtime_every=RUNTIME_EVERY,
        engine_every=ENGINE_EVERY,
    )
    report = run_fuzz(config)
    print("\n".join(summary(report)))
    assert not report.failures, "\n".join(summary(report))
    assert report.programs == programs
    # The copy-back path ran (counted as passed or as skipped with its reason).
    engine_seen = report.targets.get("kv-alias-stock", 0) + sum(
        n for (target, _), n in report.target_skips.items() if target == "kv-alias-stock"
    )
    assert engine_seen >= programs // (2 * ENGINE_EVERY), "\n".join(summary(report))
