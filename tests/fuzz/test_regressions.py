"""Bugs the fuzzer found, each pinned by the smallest program that showed it."""

from __future__ import annotations

from writeback_core.registry import Registry
from writeback_core.types import MemoryPlan
from writeback_testing.lowered_plans import Lowerings
from writeback_testing.oracle import check_program
from writeback_testing.program_spec import ProgramSpec, Source, State, Write, build
from writeback_testing.targets import registry_runtime, runtime_targets

# Found by the fuzzer (pybind-unplanned target): with graph outputs left out of the memory
# plan (alloc_graph_output=False), early write-back returned the state placeholder itself
# in place of the write-back copy, so exir counted the mutable buffer as a graph output and
# did not plan it; the emitter then stored it as constant data, deduplicated with a lifted
# constant of the same bytes (the -1.0 the program multiplies by), and every write to the
# buffer overwrote that constant. packages/passes/src/writeback_passes/early_write_back.py.
# Fixed: only user-input placeholders are returned in place of their write-back.
BUFFER_EQUAL_TO_A_CONSTANT = ProgramSpec(
    states=(State("s0", "buffer", (1,)),),  # initial contents: [-1.0]
    statements=(Write("s0", "copy", Source("x", (1,), -1.0, offset=9)),),
    outputs=("s0", "s0"),
    offset_initial=False,
)


def _buffer_planned(lowered: Lowerings, plan: MemoryPlan) -> bool:
    graph = lowered.program(plan).exported_program().graph
    (placeholder,) = [n for n in graph.nodes if n.name == "b_s0"]
    return getattr(placeholder.meta.get("spec"), "mem_id", None) is not None


def test_unplanned_outputs_keep_mutated_buffer_planned(fuzz_registry: Registry) -> None:
    lowered = Lowerings(build(BUFFER_EQUAL_TO_A_CONSTANT), fuzz_registry)
    assert _buffer_planned(lowered, "planned")
    assert _buffer_planned(lowered, "unplanned"), "the mutable buffer lost its planned slot"
    assert _buffer_planned(lowered, "state"), "the mutable buffer lost its planned slot"


def test_buffer_whose_bytes_equal_a_constant_is_not_merged_with_it(
    fuzz_registry: Registry,
) -> None:
    runtime = registry_runtime(fuzz_registry)
    check_program(BUFFER_EQUAL_TO_A_CONSTANT, runtime_targets(runtime), fuzz_registry)
