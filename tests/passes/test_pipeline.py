"""``writeback_passes.to_executorch``: passes from the ``writeback_program_passes`` hook, for the
backend, ordered by their ``after``/``before`` relations, then by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import writeback_passes
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from writeback_core import ProgramPass, Stage, hookimpl, load_registry, to_edge_arguments
from writeback_core.lowering import lower as lower_program
from writeback_core.lowering import pass_names
from writeback_passes import plugin

from .hazard_models import Plain, seeded
from .lowering import (
    DELEGATE_PASSES,
    PASSES_BY_BACKEND,
    PASSES_IN_ORDER,
    assert_runs_like_eager,
    edge_of,
    export_module,
)

_X = (seeded(1, 16),)


def _copy_follows_value(gm: torch.fx.GraphModule) -> bool:
    (copy,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    return copy.prev is copy.args[1]


class _Recorder:
    """A plugin offering probe passes that record when they ran and what they saw: per pass,
    its name and the keyword arguments of its ``ProgramPass`` (``after``, ``before``, ``backends``)."""

    writeback_name = "recorder"

    def __init__(self, passes: Sequence[tuple[str, dict[str, Any]]]) -> None:
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
        return [ProgramPass(n, stage, self._probe(n), **relations) for n, relations in self.passes]


def test_writeback_program_passes_hook_offers_early_write_back_before_memory_planning() -> None:
    registry = load_registry(entry_points=False, plugins=[plugin])
    passes = registry.program_passes("before_memory_planning", None)
    (early,) = [p for p in passes if p.name == "insert_write_back_early"]
    assert early.stage == "before_memory_planning"
    assert early.after == ("reinplace_delegate_input_mutations", "reinplace_state_writes", "copies_as_views")
    # Every other pass of this package that moves writes comes first; then the index checks,
    # which move only index computations, go before the writes where they are; then the
    # runner-input checks, which only add nodes at the head.
    assert passes[-3] is early
    assert (passes[-2].name, passes[-2].after) == ("check_indices_first", ("insert_write_back_early",))
    assert (passes[-1].name, passes[-1].after) == ("check_runner_inputs", ("check_indices_first",))
    assert registry.program_passes("edge", None) == []
    # Installed through its entry point as well.
    names = [p.name for p in load_registry().program_passes("before_memory_planning", "xnnpack")]
    assert "insert_write_back_early" in names


@pytest.mark.parametrize("backend", sorted(PASSES_BY_BACKEND, key=str))
def test_each_backend_runs_the_package_passes_that_serve_it_in_order(backend: str | None) -> None:
    """The stock runtime's lowerings run every pass in the order the integers gave; a delegate's
    backend (MLX, the example) none of the passes that rewrite for the stock kernels."""
    registry = load_registry()
    assert pass_names(registry, backend) == PASSES_BY_BACKEND[backend]
    stages: tuple[Stage, ...] = ("exported", "before_partition", "edge", "before_memory_planning", "after_out_variants")
    for stage in stages:
        for program_pass in registry.program_passes(stage, backend):
            assert program_pass.reason, f"{program_pass.name} says no reason"
            if program_pass.name not in DELEGATE_PASSES:
                assert program_pass.backends == frozenset({"portable", "xnnpack", "none"})


def test_to_executorch_runs_registered_passes_by_their_relations_then_by_name() -> None:
    recorder = _Recorder(
        [
            ("late", {"after": ("insert_write_back_early",)}),
            ("b_before_early", {"before": ("insert_write_back_early",)}),
            ("a_before_early", {"before": ("insert_write_back_early",)}),
        ]
    )
    registry = load_registry(entry_points=False, plugins=[recorder, plugin])
    config = ExecutorchBackendConfig(emit_mutable_buffer_names=True)
    program = writeback_passes.to_executorch(edge_of(Plain(), _X), config, registry=registry)
    # insert_write_back_early runs after both "*_before_early" passes: only "late" sees the move.
    assert recorder.seen == [("a_before_early", False), ("b_before_early", False), ("late", True)]
    assert_runs_like_eager(program, Plain(), lambda step: (seeded(step, 16),))


def test_registration_order_never_changes_pass_order() -> None:
    first = _Recorder([("b", {}), ("a", {})])
    second = _Recorder([("b", {}), ("a", {})])
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
    relations = {"after": ("check_indices_first",), "optional": ("check_indices_first",)}
    recorder = _Recorder([("after_everything", relations)])
    writeback_passes.to_executorch(edge_of(Plain(), _X), registry=load_registry(entry_points=False, plugins=[recorder]))
    assert recorder.seen == [("after_everything", False)]


class _BadPass:
    writeback_name = "bad"

    @hookimpl
    def writeback_program_passes(self, stage: Stage) -> Sequence[ProgramPass]:
        if stage == "before_memory_planning":
            return [ProgramPass("returns_a_string", stage, lambda gm: "done")]
        return [ProgramPass("edge_returns_new", stage, lambda ep: object())]


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
                )
            ]

    writeback_passes.to_executorch(
        edge_of(Plain(), _X), registry=load_registry(entry_points=False, plugins=[EdgeProbe()])
    )
    assert seen == [0]


class _Counted:
    """A plugin offering one ``before_memory_planning`` pass for ``backends``, counting its runs."""

    writeback_name = "counted"

    def __init__(self, backends: frozenset[str]) -> None:
        self.backends = backends
        self.runs = 0

    def _count(self, gm: torch.fx.GraphModule) -> None:
        self.runs += 1

    @hookimpl
    def writeback_program_passes(self, stage: Stage) -> Sequence[ProgramPass]:
        if stage != "before_memory_planning":
            return ()
        return [ProgramPass("counted", stage, self._count, backends=self.backends)]


@pytest.mark.parametrize(
    ("backends", "lowered_for", "runs"),
    [
        ({"portable"}, "portable", 1),
        ({"portable"}, "xnnpack", 0),
        ({"portable"}, None, 0),
        ({"none"}, None, 1),
        ({"none"}, "portable", 0),
    ],
)
def test_a_pass_for_some_backends_runs_only_in_their_lowerings(
    backends: set[str], lowered_for: str | None, runs: int
) -> None:
    counted = _Counted(frozenset(backends))
    registry = load_registry(entry_points=False, plugins=[plugin, counted])
    spec = registry.backends()[lowered_for] if lowered_for is not None else None
    lowered = lower_program(export_module(Plain(), _X), registry, spec)
    assert counted.runs == runs
    assert ("counted" in lowered.passes) is bool(runs)
    assert [n for n in lowered.passes if n != "counted"] == list(PASSES_IN_ORDER)


def test_to_executorch_reads_the_backend_from_the_program_unless_told() -> None:
    """After ``to_edge_arguments("portable")`` the portable passes run; ``backend=None`` says
    the program was lowered with no backend, whose passes do not include it."""
    counted = _Counted(frozenset({"portable"}))
    registry = load_registry(entry_points=False, plugins=[plugin, counted])

    def edge() -> Any:
        arguments = to_edge_arguments("portable", registry=registry)
        return to_edge_transform_and_lower(export_module(Plain(), _X), **arguments)

    writeback_passes.to_executorch(edge(), registry=registry)
    assert counted.runs == 1
    writeback_passes.to_executorch(edge(), registry=registry, backend=None)
    assert counted.runs == 1
    writeback_passes.to_executorch(edge(), registry=registry, backend="portable")
    assert counted.runs == 2
