"""The oracle itself: it passes a right pipeline, catches a wrong one, and what it prints
reproduces the failure."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.fx
from writeback_core import ProgramPass, hookimpl
from writeback_core.registry import Registry, load_registry
from writeback_testing.lowered_plans import Lowerings
from writeback_testing.observations import Observation
from writeback_testing.oracle import HarnessError, ProgramMismatch, TargetError, check_program, check_source
from writeback_testing.program_spec import ProgramSpec, Read, Source, State, Write, build
from writeback_testing.targets import StockTarget, registry_runtime, runtime_targets

from .conftest import FUZZ_PLUGINS

# A cache-like buffer written at ``pos`` and a caller-owned running sum, with an old
# value read before the write and used after it.
SPEC = ProgramSpec(
    states=(State("s0", "buffer", (4, 3)), State("s1", "input", (3,))),
    statements=(
        Read("t0", "s0", "sum"),
        Write("s0", "index_copy", Source("x", (1, 3), 0.5), dim=0, index=None),
        Write("s1", "add", Source("x", (3,), -1.0, offset=5)),
    ),
    outputs=("t0", "s0"),
)


class DropWriteBacks:
    """A deliberately wrong pass: erases every write-back ``copy_`` into a placeholder."""

    writeback_name = "drop-write-backs"

    @staticmethod
    def _run(gm: torch.fx.GraphModule) -> None:
        for node in list(gm.graph.nodes):
            is_copy = node.op == "call_function" and "copy_" in str(node.target)
            if is_copy and node.args[0].op == "placeholder":
                node.replace_all_uses_with(node.args[1])
                gm.graph.erase_node(node)
        gm.recompile()

    @hookimpl
    def writeback_program_passes(self, stage: str) -> Sequence[ProgramPass]:
        if stage != "before_memory_planning":
            return ()
        return (ProgramPass("drop_write_backs", "before_memory_planning", self._run, after=("check_indices_first",)),)


def test_oracle_passes_the_pipeline_on_a_program_it_can_check(fuzz_registry: Registry) -> None:
    runtime = registry_runtime(fuzz_registry)
    report = check_program(SPEC, [StockTarget(), *runtime_targets(runtime)], fuzz_registry)
    assert report.targets == ["stock", "pybind-planned", "pybind-state", "pybind-unplanned-bound"]


def test_oracle_catches_dropped_write_back_and_its_reproducer_reproduces() -> None:
    import importlib

    plugins = [importlib.import_module(m) for m in FUZZ_PLUGINS] + [DropWriteBacks()]
    broken = load_registry(entry_points=False, plugins=plugins)
    with pytest.raises(ProgramMismatch) as caught:
        check_program(SPEC, [StockTarget()], broken)
    error = caught.value
    assert error.target == "stock"
    assert error.upstream is False, "exir alone is right: the fault is the registered pass"
    assert "def forward(self, x, pos, s1):" in str(error)
    # The printed source alone is enough to reproduce it.
    assert error.source == build(SPEC).source
    with pytest.raises(ProgramMismatch):
        check_source(error.source, [StockTarget()], broken)


def test_oracle_refuses_fewer_than_three_calls(fuzz_registry: Registry) -> None:
    with pytest.raises(ValueError, match="at least 3"):
        check_program(SPEC, [StockTarget()], fuzz_registry, calls=2)


# Drawn three times by the CI fuzz run (chunk 3) since constant sources came in: stock
# ExecuTorch 1.5.1 cannot load a program that reads a one-element buffer through a view and
# writes it with a value computed from constants, once the buffer is initialised
# (InitializedMutableBufferPass): the runtime logs "offset index 2 out of range >= 2" and
# refuses the method (0x20). Reduced by hand from the drawn program. The cause is exir's
# emitter: with emit_mutable_buffer_names (what lets a runtime read a buffer by name) a
# mutable tensor's initial bytes are looked up among the constants, so the view, emitted
# after the lifted scalar -1.0, takes that constant's index as its mutable-data index. It
# loads with the names off, with a buffer whose bytes equal no constant (-2.0, or a (2,)
# buffer), or without the view.
UPSTREAM_LOAD_FAILURE = """import torch


class FuzzModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s0', torch.full((1,), -1.0))

    def forward(self, x):
        t0 = self.s0.view(-1) + 1.0
        self.s0.copy_(torch.arange(5, 6, dtype=torch.float32) * -1.0)
        return t0


def step_inputs(step):
    return (torch.ones(32),)


def make_state():
    return ()
"""


def test_a_program_stock_cannot_load_without_writeback_either_is_an_upstream_error_not_a_pass(
    fuzz_registry: Registry,
) -> None:
    with pytest.raises(TargetError, match=r"0x:20 \(fails without writeback's passes too \(upstream\)\)") as caught:
        check_source(UPSTREAM_LOAD_FAILURE, [StockTarget("stock")], fuzz_registry)
    assert caught.value.upstream is True and caught.value.target == "stock"
    assert "register_buffer('s0'" in str(caught.value)  # the reproducer comes with it


class BrokenHarnessTarget:
    """A target with a bug of its own: it reads an attribute ``Lowerings`` does not have."""

    name = "broken-harness"

    def run(self, lowered: Lowerings, calls: int) -> list[Observation]:
        return lowered.no_such_attribute  # type: ignore[attr-defined, no-any-return]  # the deliberate bug


def test_a_harness_bug_is_a_harness_error_never_an_upstream_skip(fuzz_registry: Registry) -> None:
    """Hazard from the review: any exception, a harness bug included, failed the bare run
    too, so it was called "upstream" and the fuzzer skipped the program."""
    with pytest.raises(HarnessError, match=r"AttributeError: .*no_such_attribute.*a bug of the test harness") as caught:
        check_program(SPEC, [BrokenHarnessTarget()], fuzz_registry)
    assert not isinstance(caught.value, TargetError)
    assert caught.value.target == "broken-harness" and "test_oracle.py:" in caught.value.where
