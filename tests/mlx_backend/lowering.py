"""Helpers of the MLX backend tests: real export, real exir lowering with the MLX partitioner
and the registered passes, real pybind-runtime, real MLX."""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import writeback_mlx_backend.plugin as mlx_plugin
import writeback_passes
import writeback_passes.plugin as passes_plugin
from executorch.exir import (
    ExecutorchBackendConfig,
    ExecutorchProgramManager,
    to_edge_transform_and_lower,
)
from executorch.exir.delegate import executorch_call_delegate
from executorch.exir.passes import MemoryPlanningPass
from torch.export import ExportedProgram
from writeback_core.registry import Registry, load_registry
from writeback_mlx_backend import MLXDelegate, MLXPartitioner
from writeback_pybind_runtime import Method, Runtime


def registry(*extra: object) -> Registry:
    """A fresh registry with the MLX backend and the passes plugins (no entry points)."""
    return load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, *extra])


def export_module(module: torch.nn.Module, args: tuple[Any, ...]) -> ExportedProgram:
    """torch.export as the project does: eval, no grad, non-strict."""
    module = module.eval().requires_grad_(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(module, args, strict=False)


@dataclass
class Lowered:
    """A module lowered to MLX and to ExecuTorch, with the partitioner that did it."""

    program: ExecutorchProgramManager
    partitioner: MLXPartitioner
    registry: Registry

    @property
    def pte(self) -> bytes:
        return bytes(self.program.buffer)

    def graph_targets(self) -> list[str]:
        """The ``call_function`` targets of the final top-level graph, by name."""
        graph = self.program.exported_program().graph
        return [getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"]

    def write_backs(self) -> list[str]:
        """Placeholders still written back by a ``copy_`` in the final top-level graph."""
        graph = self.program.exported_program().graph
        return [
            n.args[0].name
            for n in graph.nodes
            if n.op == "call_function"
            and "copy_" in str(n.target)
            and isinstance(n.args[0], torch.fx.Node)
            and n.args[0].op == "placeholder"
        ]

    def delegated_ops(self) -> set[str]:
        """The ops inside every MLX delegate of the program (``aten.mm.default`` style)."""
        from executorch.exir.lowered_backend_module import LoweredBackendModule
        from writeback_mlx_backend.ops import op_key

        found = set()
        for module in self.program.exported_program().graph_module.children():
            if isinstance(module, LoweredBackendModule):
                found |= {op_key(n.target) for n in module.original_module.graph.nodes if n.op == "call_function"}
        return found

    def only_delegate_runs(self) -> bool:
        """Whether every op of the program runs inside the MLX delegate."""
        graph = self.program.exported_program().graph
        allowed = {executorch_call_delegate, operator.getitem}
        return all(n.target in allowed for n in graph.nodes if n.op == "call_function")

    def method(self) -> Method:
        """The ``forward`` method, loaded by the pybind-runtime with this test's registry."""
        runtime = Runtime(self.registry)
        self.delegates = runtime.register_delegates(self.registry)
        return runtime.load_program(self.pte).load_method("forward")

    def delegate(self) -> MLXDelegate:
        """The MLX delegate object the runtime registered (after :meth:`method`)."""
        found = self.delegates["WritebackMLXBackend"]
        assert isinstance(found, MLXDelegate)
        return found


def lower_mlx(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    *,
    planned_inputs: bool = True,
    registry_: Registry | None = None,
    own_buffers: bool = True,
    passes: bool = True,
) -> Lowered:
    """Export ``module``, lower it with :class:`MLXPartitioner` and run ``to_executorch``.

    With ``passes`` the registered passes run (``writeback_passes.to_executorch``),
    so write-backs the delegate accepted are dropped; without, stock exir.
    """
    reg = registry_ if registry_ is not None else registry()
    partitioner = MLXPartitioner(reg, own_buffers=own_buffers)
    program = export_module(module, args)
    config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=planned_inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        edge = to_edge_transform_and_lower(program, partitioner=[partitioner])
        if passes:
            manager = writeback_passes.to_executorch(edge, config, registry=reg)
        else:
            manager = edge.to_executorch(config)
    return Lowered(manager, partitioner, reg)
