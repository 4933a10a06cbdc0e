"""``reinplace_delegate_input_mutations`` on real lowered programs: it drops only the
write-backs whose mutation the backend accepted, and refuses the review's hazards."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
import writeback_mlx_backend.plugin as mlx_plugin
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.delegate import executorch_call_delegate
from torch.fx.passes.infra.pass_base import PassResult
from writeback_core import Mutation, PartitionView, Registry, annotating, hookimpl, load_registry
from writeback_mlx_backend import MLXPartitioner
from writeback_passes import (
    IN_PLACE_OUTPUTS_SPEC,
    ReinplaceReport,
    reinplace_delegate_input_mutations,
)


class TwoCaches(torch.nn.Module):
    def forward(self, pos: torch.Tensor, k: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        kc.index_copy_(0, pos, k)
        vc.index_copy_(0, pos, k * 2.0)
        return kc.sum() + vc.sum()


ARGS = (torch.tensor([1]), torch.ones(1, 3), torch.zeros(4, 3), torch.zeros(4, 3))

Edit = Callable[[torch.fx.GraphModule], Callable[[], None]]


class DeclineAll:
    """Without the MLX plugin: a plugin that declines every mutation of the ``mlx`` backend."""

    writeback_name = "decline-all"

    @hookimpl
    def writeback_accepts_in_place(self, backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
        return False if backend == "mlx" else None


def _mlx(registry: Registry | None) -> Any:
    """The MLX partitioner as core's lowering path uses it (bare: no decision recorded)."""
    return MLXPartitioner() if registry is None else annotating(MLXPartitioner(), "mlx", registry)


def _run(plugins: list[object] | None, edit: Edit | None = None) -> tuple[ReinplaceReport, Any]:
    """Lower ``TwoCaches`` to MLX and run the pass where exir runs ``config.passes``.

    ``edit`` may change the graph first; it returns an undo so exir can finish.
    """
    registry = load_registry(entry_points=False, plugins=plugins) if plugins is not None else None
    module = TwoCaches().eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, ARGS, strict=False)
        edge = to_edge_transform_and_lower(program, partitioner=[_mlx(registry)])
    reports: list[ReinplaceReport] = []

    def stage(gm: torch.fx.GraphModule) -> PassResult:
        undo = edit(gm) if edit is not None else None
        reports.append(reinplace_delegate_input_mutations(gm))
        if undo is not None:
            undo()
        return PassResult(gm, True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        manager = edge.to_executorch(ExecutorchBackendConfig(passes=[stage]))
    return reports[0], manager


def _write_backs(manager: Any) -> set[str]:
    graph = manager.exported_program().graph
    return {n.args[0].name for n in graph.nodes if n.op == "call_function" and "copy_" in str(n.target)}


def _call(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target is executorch_call_delegate)


def _placeholder(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name)


def test_accepted_write_backs_are_dropped_and_the_delegate_is_told() -> None:
    report, manager = _run([mlx_plugin])
    assert {d.placeholder for d in report.dropped} == {"kc", "vc"}
    assert report.kept == []
    assert _write_backs(manager) == set()
    gm = manager.exported_program().graph_module
    lowered = getattr(gm, str(_call(gm).args[0].target))
    (spec,) = [s for s in lowered.compile_specs if s.key == IN_PLACE_OUTPUTS_SPEC]
    entries = json.loads(spec.value)
    args = [a.name for a in _call(gm).args[1:]]
    assert sorted(args[e["input"]] for e in entries) == ["kc", "vc"]
    # The method returns the inputs themselves as the mutated values.
    outputs = gm.graph.output_node().args[0]
    assert [o.name for o in outputs[:2]] == ["kc", "vc"]


def test_mutations_without_a_decision_are_untouched() -> None:
    report, manager = _run(None)
    assert report.dropped == [] and report.kept == []
    assert _write_backs(manager) == {"kc", "vc"}


def test_declined_mutations_are_untouched() -> None:
    """Through ``writeback_accepts_in_place``: a plugin that says no keeps every copy."""
    report, manager = _run([DeclineAll()])
    assert report.dropped == [] and report.kept == []
    assert _write_backs(manager) == {"kc", "vc"}


def test_reader_between_delegate_and_write_back_keeps_the_copy() -> None:
    def add_reader(gm: torch.fx.GraphModule) -> Callable[[], None]:
        kc = _placeholder(gm, "kc")
        with gm.graph.inserting_after(_call(gm)):
            reader = gm.graph.call_function(torch.ops.aten.sum.default, (kc,))

        def undo() -> None:
            gm.graph.erase_node(reader)

        return undo

    report, manager = _run([mlx_plugin], add_reader)
    kept = {k.placeholder: k.reason for k in report.kept}
    assert set(kept) == {"kc"}
    assert "reads kc between the delegate and the write-back" in kept["kc"]
    assert [d.placeholder for d in report.dropped] == ["vc"]
    assert _write_backs(manager) == {"kc"}


def test_alias_passed_twice_to_the_delegate_keeps_the_copy() -> None:
    def pass_alias(gm: torch.fx.GraphModule) -> Callable[[], None]:
        call = _call(gm)
        kc = _placeholder(gm, "kc")
        with gm.graph.inserting_before(call):
            alias = gm.graph.call_function(torch.ops.aten.alias.default, (kc,))
        original = call.args
        call.args = (*original, alias)

        def undo() -> None:
            call.args = original
            gm.graph.erase_node(alias)

        return undo

    report, _ = _run([mlx_plugin], pass_alias)
    kept = {k.placeholder: k.reason for k in report.kept}
    assert set(kept) == {"kc"}
    assert "alias of 'kc'" in kept["kc"]
    assert [d.placeholder for d in report.dropped] == ["vc"]


@pytest.mark.parametrize("backend", ["mlx", "example", None])
def test_pass_is_registered_through_writeback_program_passes(backend: str | None) -> None:
    import writeback_passes.plugin as passes_plugin

    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    names = [p.name for p in registry.program_passes("before_memory_planning", backend)]
    assert names.index("reinplace_delegate_input_mutations") < names.index("insert_write_back_early")


class OnlyStateWrites(torch.nn.Module):
    """Two one-slot cache writes, each the only result of its own example-backend delegate:
    ``kc`` a buffer, ``vc`` the caller's tensor. The output reads both before they are written,
    so each call shows what the previous call wrote without reading a delegate result."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kc", torch.zeros(4, 3))

    def forward(self, pos: torch.Tensor, k: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        seen = self.kc * 1.0 + vc.sum()
        self.kc.index_copy_(0, pos, k)
        vc.index_copy_(0, pos, k * 2.0)
        return seen


def _example_registry() -> Any:
    import writeback_example_backend.plugin as example_plugin
    import writeback_passes.plugin as passes_plugin
    import writeback_pybind_runtime.plugin as pybind_plugin

    return load_registry(entry_points=False, plugins=[passes_plugin, pybind_plugin, example_plugin])


def _lower_to_example(registry: Any, planned: bool) -> Any:
    from executorch.exir.passes import MemoryPlanningPass
    from writeback_example_backend.backend import ExamplePartitioner
    from writeback_passes import to_executorch

    args = (torch.tensor([0]), torch.ones(1, 3), torch.zeros(4, 3))
    module = OnlyStateWrites().eval().requires_grad_(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, args, strict=False)
        edge = to_edge_transform_and_lower(program, partitioner=[annotating(ExamplePartitioner(), "example", registry)])
        config = ExecutorchBackendConfig(
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=planned, alloc_graph_output=planned)
        )
        return to_executorch(edge, config, registry=registry)


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_delegate_whose_only_results_were_dropped_write_backs_still_runs(planned: bool) -> None:
    """Hazard: dropping every accepted write-back of a delegate left its call with no users,
    and exir's dead-code elimination deleted it, so the state was never written. The call
    must survive to the .pte with zero write-back copies, and the real runtime must write the
    caller's cache and the buffer as eager PyTorch does, call after call."""
    from writeback_testing.targets import registry_runtime

    registry = _example_registry()
    manager = _lower_to_example(registry, planned)
    graph = manager.exported_program().graph
    assert sum(1 for n in graph.nodes if n.target is executorch_call_delegate) == 2
    assert _write_backs(manager) == set()

    runtime = registry_runtime(registry)
    assert runtime is not None
    method = runtime.load_program(bytes(manager.buffer)).load_method("forward")
    eager = OnlyStateWrites()
    vc, eager_vc = torch.zeros(4, 3), torch.zeros(4, 3)
    for step in range(4):
        pos, k = torch.tensor([step]), torch.full((1, 3), step + 1.0)
        got = method.execute([pos, k, vc])
        want = eager(pos, k, eager_vc)
        torch.testing.assert_close(vc, eager_vc)  # the caller's tensor, written in place
        torch.testing.assert_close(got[-1], want)  # reads kc and vc as the last call left them
