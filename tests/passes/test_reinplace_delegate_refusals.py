"""The refusals of ``reinplace_delegate_input_mutations`` that a backend's own rule usually
spares it, each made to fire by a real program lowered with real exir.

The MLX plugin declines a state its partition does not read and a buffer also returned
(``test_in_place_refusals.py``); a third-party backend may accept them, and then this pass
is what keeps the copy. Here a plugin that accepts every mutation stands for such a
backend. Each program that keeps its copy is run on the real runtime against eager
PyTorch: the refused write-back is kept, so no call is wrong.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import writeback_mlx_backend.plugin as mlx_plugin
import writeback_passes.plugin as passes_plugin
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.delegate import executorch_call_delegate
from torch.fx.passes.infra.pass_base import PassResult
from writeback_core import Mutation, PartitionView, annotating, hookimpl, load_registry
from writeback_mlx_backend import MLXPartitioner
from writeback_passes import ReinplaceReport, reinplace_delegate_input_mutations
from writeback_pybind_runtime import Runtime

from tests.mlx_backend.test_in_place_refusals import ReplacedUnread, scatter_inputs


class AcceptAll:
    """A backend's rule that accepts every mutation its partitions touch."""

    writeback_name = "accept-all"

    @hookimpl
    def writeback_accepts_in_place(self, backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
        return True


Edit = Callable[[torch.fx.GraphModule], None]


def _lower(
    module: torch.nn.Module, args: tuple[Any, ...], partitioner: Any, plugins: list[object], edit: Edit | None = None
) -> tuple[ReinplaceReport, Any]:
    """Lower ``module`` with ``partitioner`` (core records the plugins' decisions) and run the
    pass where exir runs ``config.passes``, after ``edit`` (a user's earlier pass)."""
    registry = load_registry(entry_points=False, plugins=plugins)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.export.export(module.eval(), args, strict=False)
        edge = to_edge_transform_and_lower(program, partitioner=[annotating(partitioner, "mlx", registry)])
    reports: list[ReinplaceReport] = []

    def stage(gm: torch.fx.GraphModule) -> PassResult:
        if edit is not None:
            edit(gm)
        reports.append(reinplace_delegate_input_mutations(gm))
        return PassResult(gm, True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        manager = edge.to_executorch(ExecutorchBackendConfig(passes=[stage]))
    return reports[0], manager


def _write_backs(manager: Any) -> list[str]:
    graph = manager.exported_program().graph
    return [n.args[0].name for n in graph.nodes if n.op == "call_function" and "copy_" in str(n.target)]


def _runs_like_eager(
    manager: Any, build: Callable[[], torch.nn.Module], inputs: Callable[[int], tuple[Any, ...]]
) -> None:
    """Three calls of the lowered program (MLX delegate registered) against eager PyTorch."""
    registry = load_registry(entry_points=False, plugins=[mlx_plugin])
    runtime = Runtime(registry)
    runtime.register_delegates(registry)
    method = runtime.load_program(bytes(manager.buffer)).load_method("forward")
    eager = build().eval()
    for step in range(3):
        args = inputs(step)
        got = method.execute(list(args))
        with torch.no_grad():
            want = eager(*args)
        torch.testing.assert_close(got[-1], want)


def test_state_not_passed_to_its_delegate_keeps_the_copy_not_wrong() -> None:
    report, manager = _lower(ReplacedUnread(), scatter_inputs(0), MLXPartitioner(own_buffers=False), [AcceptAll()])
    assert report.dropped == []
    assert [(k.placeholder, k.reason) for k in report.kept] == [("b_c", "'b_c' is passed to the delegate 0 times")]
    assert _write_backs(manager) == ["b_c"]
    _runs_like_eager(manager, ReplacedUnread, scatter_inputs)


class ReturnsItsCache(torch.nn.Module):
    """``cache[pos] = k``, and the cache's new value is what the model returns."""

    cache: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, k)
        return self.cache


def _row_inputs(step: int) -> tuple[torch.Tensor, ...]:
    return torch.tensor([step % 4]), torch.full((1, 3), step + 1.0)


def test_buffer_whose_new_value_is_also_returned_keeps_the_copy_not_wrong() -> None:
    report, manager = _lower(ReturnsItsCache(), _row_inputs(0), MLXPartitioner(own_buffers=False), [AcceptAll()])
    assert report.dropped == []
    ((placeholder, reason),) = [(k.placeholder, k.reason) for k in report.kept]
    assert placeholder == "b_cache"
    assert reason.startswith("the program also returns the new value of buffer 'b_cache': ")
    assert _write_backs(manager) == ["b_cache"]
    _runs_like_eager(manager, ReturnsItsCache, _row_inputs)


class CacheWrite(torch.nn.Module):
    def forward(self, pos: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, k)
        return k.sum(0)


class OnlyCacheWrite(torch.nn.Module):
    """The cache write is the delegate's only result: the model returns an input as it came."""

    def forward(self, pos: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, k)
        return pos


def _return_the_input_not_its_write_back(gm: torch.fx.GraphModule) -> None:
    """A user's ``config.passes`` pass that makes the output return the caller's tensor
    itself, leaving exir's write-back ``copy_`` with no reader."""
    output = gm.graph.output_node()
    copy = next(n for n in output.all_input_nodes if "copy_" in str(n.target))
    placeholder = copy.args[0]
    assert isinstance(placeholder, torch.fx.Node)
    output.replace_input_with(copy, placeholder)


def test_write_back_that_alone_keeps_its_delegate_is_kept() -> None:
    """The write-back is the only reader of the delegate's only read result and nothing reads
    the write-back: dropping it would let exir's dead-code elimination delete the delegate
    call, and the cache would never be written."""
    args = (torch.tensor([1]), torch.ones(1, 3), torch.zeros(4, 3))
    report, manager = _lower(
        OnlyCacheWrite(), args, MLXPartitioner(), [mlx_plugin, passes_plugin], _return_the_input_not_its_write_back
    )
    assert report.dropped == []
    ((placeholder, reason),) = [(k.placeholder, k.reason) for k in report.kept]
    assert placeholder == "cache"
    assert reason == (
        "the write-back of 'cache' is the delegate's last used result and the program does not "
        "return it: nothing would keep the delegate call"
    )
    graph = manager.exported_program().graph
    assert any(n.target is executorch_call_delegate for n in graph.nodes)
    assert _write_backs(manager) == ["cache"]


def test_state_written_by_a_kernel_is_left_to_the_kernel_pass() -> None:
    """``portable``: core records the stock kernels' acceptance on a cache no delegate writes;
    the value written back is then no delegate output, and this pass leaves it alone (the
    kernel pass, ``reinplace_state_writes``, writes it in place)."""
    from writeback_passes.backends import NoDelegatePartitioner

    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    args = (torch.tensor([1]), torch.ones(1, 3), torch.zeros(4, 3))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.export.export(CacheWrite().eval(), args, strict=False)
        partitioner = annotating(NoDelegatePartitioner(), "portable", registry)
        edge = to_edge_transform_and_lower(program, partitioner=[partitioner])
    assert [(d.target, d.accepted) for d in partitioner.decisions] == [("cache", True)]
    reports: list[ReinplaceReport] = []

    def stage(gm: torch.fx.GraphModule) -> PassResult:
        reports.append(reinplace_delegate_input_mutations(gm))
        return PassResult(gm, True)

    edge.to_executorch(ExecutorchBackendConfig(passes=[stage]))
    assert reports[0].dropped == []
    assert [(k.placeholder, k.reason) for k in reports[0].kept] == [
        ("cache", "the value written back is not a delegate output")
    ]
