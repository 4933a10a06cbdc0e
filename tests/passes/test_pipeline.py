"""``writeback_passes.to_executorch``: passes from the ``writeback_program_passes`` hook, in (order, name) order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import writeback_passes
from executorch.exir import ExecutorchBackendConfig
from writeback_core import ProgramPass, Stage, hookimpl, load_registry
from writeback_passes import EARLY_WRITE_BACK_ORDER, plugin

from .hazard_models import Plain, seeded
from .lowering import assert_runs_like_eager, edge_of

_X = (seeded(1, 16),)


def _copy_follows_value(gm: torch.fx.GraphModule) -> bool:
    (copy,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    return copy.prev is copy.args[1]


class _Recorder:
    """A plugin offering probe passes that record when they ran and what they saw."""

    writeback_name = "recorder"

    def __init__(self, passes: Sequence[tuple[str, int]]) -> None:
        self.passes = passes
        self.seen: list[tuple[str, bool]] = []

    def _probe(self, name: str) -> Any:
        def run(gm: torch.fx.GraphModule) -> None:
            self.seen.append((name, _copy_follows_value(gm)))

        return run

    @hookimpl
    def writeback_program_passes(self, stage: Stage) -> Sequence[ProgramPass]:
        if stage != "before_memory_planning":
            return ()
        return [ProgramPass(n, stage, self._probe(n), order) for n, order in self.passes]


def test_writeback_program_passes_hook_offers_early_write_back_before_memory_planning() -> None:
    registry = load_registry(entry_points=False, plugins=[plugin])
    passes = registry.program_passes("before_memory_planning")
    (early,) = [p for p in passes if p.name == "insert_write_back_early"]
    assert (early.stage, early.order) == ("before_memory_planning", 100)
    assert EARLY_WRITE_BACK_ORDER == 100
    # Every other pass of this package that moves writes comes first; then the index checks
    # (order 110), which move only index computations, go before the writes where they are.
    assert passes[-2] is early
    assert (passes[-1].name, passes[-1].order) == ("check_indices_first", 110)
    assert registry.program_passes("edge") == []
    # Installed through its entry point as well.
    names = [p.name for p in load_registry().program_passes("before_memory_planning")]
    assert "insert_write_back_early" in names


def test_to_executorch_runs_registered_passes_in_order_then_name_order() -> None:
    recorder = _Recorder([("late", 150), ("a_first_at_100", 100), ("early_bird", 50)])
    registry = load_registry(entry_points=False, plugins=[recorder, plugin])
    config = ExecutorchBackendConfig(emit_mutable_buffer_names=True)
    program = writeback_passes.to_executorch(edge_of(Plain(), _X), config, registry=registry)
    # insert_write_back_early (order 100) sorts after "a_first_at_100": only "late" sees the move.
    assert recorder.seen == [("early_bird", False), ("a_first_at_100", False), ("late", True)]
    assert_runs_like_eager(program, Plain(), lambda step: (seeded(step, 16),))


def test_registration_order_never_changes_pass_order() -> None:
    first = _Recorder([("b", 10), ("a", 10)])
    second = _Recorder([("b", 10), ("a", 10)])
    writeback_passes.to_executorch(
        edge_of(Plain(), _X), registry=load_registry(entry_points=False, plugins=[first, plugin])
    )
    writeback_passes.to_executorch(
        edge_of(Plain(), _X), registry=load_registry(entry_points=False, plugins=[plugin, second])
    )
    assert [n for n, _ in first.seen] == [n for n, _ in second.seen] == ["a", "b"]


def test_user_config_passes_run_first_and_config_is_not_changed() -> None:
    seen: list[bool] = []

    def user_pass(gm: torch.fx.GraphModule) -> Any:
        from torch.fx.passes.infra.pass_base import PassResult

        seen.append(_copy_follows_value(gm))
        return PassResult(gm, False)

    config = ExecutorchBackendConfig(passes=[user_pass])
    writeback_passes.to_executorch(
        edge_of(Plain(), _X), config, registry=load_registry(entry_points=False, plugins=[plugin])
    )
    assert seen == [False]
    assert config.passes == [user_pass]


def test_without_the_plugin_write_backs_stay_where_exir_puts_them() -> None:
    recorder = _Recorder([("after_everything", 1000)])
    writeback_passes.to_executorch(edge_of(Plain(), _X), registry=load_registry(entry_points=False, plugins=[recorder]))
    assert recorder.seen == [("after_everything", False)]


class _BadPass:
    writeback_name = "bad"

    @hookimpl
    def writeback_program_passes(self, stage: Stage) -> Sequence[ProgramPass]:
        if stage == "before_memory_planning":
            return [ProgramPass("returns_a_string", stage, lambda gm: "done", 5)]
        return [ProgramPass("edge_returns_new", stage, lambda ep: object(), 5)]


def test_edge_pass_returning_a_new_program_is_refused_naming_the_pass() -> None:
    with pytest.raises(TypeError, match="'edge' pass 'edge_returns_new' returned a new program for method 'forward'"):
        writeback_passes.to_executorch(
            edge_of(Plain(), _X), registry=load_registry(entry_points=False, plugins=[_BadPass()])
        )


def test_pass_returning_something_without_graph_module_is_refused_naming_the_pass() -> None:
    class OnlyLate(_BadPass):
        @hookimpl
        def writeback_program_passes(self, stage: Stage) -> Sequence[ProgramPass]:
            return list(super().writeback_program_passes(stage)) if stage == "before_memory_planning" else []

    with pytest.raises(TypeError, match="pass 'returns_a_string' returned str"):
        writeback_passes.to_executorch(
            edge_of(Plain(), _X), registry=load_registry(entry_points=False, plugins=[OnlyLate()])
        )


def test_edge_pass_runs_in_place_before_write_backs_exist() -> None:
    seen: list[int] = []

    class EdgeProbe:
        writeback_name = "edge-probe"

        @hookimpl
        def writeback_program_passes(self, stage: Stage) -> Sequence[ProgramPass]:
            if stage != "edge":
                return ()
            return [
                ProgramPass(
                    "count_copies",
                    stage,
                    lambda ep: seen.append(sum(n.target is torch.ops.aten.copy_.default for n in ep.graph.nodes)),
                    0,
                )
            ]

    writeback_passes.to_executorch(
        edge_of(Plain(), _X), registry=load_registry(entry_points=False, plugins=[EdgeProbe()])
    )
    assert seen == [0]
