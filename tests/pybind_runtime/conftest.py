"""Shared helpers of the pybind-runtime tests: export a module to ``.pte`` bytes,
with inputs and outputs memory planned or not, and load it in either runtime."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig, to_edge, to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass
from writeback_core.registry import load_registry
from writeback_pybind_runtime import Method, Runtime

Lower = Callable[..., bytes]


def to_pte(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    *,
    planned_inputs: bool = True,
    planned_outputs: bool = True,
    partitioners: Sequence[Any] = (),
    dynamic_shapes: Any = None,
) -> bytes:
    """Export ``module`` (non-strict, no grad) and return its ``.pte`` bytes."""
    module = module.eval().requires_grad_(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.export.export(module, args, strict=False, dynamic_shapes=dynamic_shapes)
    config = ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=planned_inputs, alloc_graph_output=planned_outputs)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if partitioners:
            edge = to_edge_transform_and_lower(program, partitioner=list(partitioners))
        else:
            edge = to_edge(program)
        return bytes(edge.to_executorch(config).buffer)


@pytest.fixture(scope="session")
def mlp_pte_bytes() -> dict[str, bytes]:
    """The isolated worker's stateful MLP lowered once per test session: ``planned``
    (inputs and outputs memory planned), ``unplanned`` (neither), ``xnnpack`` (its
    weights in an XNNPACK delegate blob read at ``load_method``). Bytes, so no test can
    change what another one loads; a test that changes a file writes its own copy."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from tests.pybind_runtime.isolated_worker import EXAMPLE, StatefulMLP

    return {
        "planned": to_pte(StatefulMLP(), EXAMPLE),
        "unplanned": to_pte(StatefulMLP(), EXAMPLE, planned_inputs=False, planned_outputs=False),
        "xnnpack": to_pte(StatefulMLP(), EXAMPLE, partitioners=[XnnpackPartitioner()]),
    }


@pytest.fixture
def lower() -> Lower:
    """``lower(module, args, planned_inputs=..., planned_outputs=...) -> bytes``."""
    return to_pte


@pytest.fixture
def runtime() -> Runtime:
    """A runtime whose registry has no entry-point plugins (so no sibling's delegates)."""
    return Runtime(load_registry(entry_points=False))


@pytest.fixture
def load(runtime: Runtime) -> Callable[[bytes], Method]:
    """``load(pte_bytes) -> Method`` for ``forward`` in this runtime."""

    def make(pte: bytes, name: str = "forward") -> Method:
        return runtime.load_program(pte).load_method(name)

    return make


def stock_method(pte: bytes, name: str = "forward") -> Any:
    """The same program's method in stock ``executorch.runtime``."""
    from executorch.runtime import Runtime as StockRuntime

    return StockRuntime.get().load_program(pte).load_method(name)
