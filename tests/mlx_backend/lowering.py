"""Helpers of the MLX backend tests: real export and lowering through core's one lowering
path (MLX partitioner, registered passes), real pybind-runtime, real MLX."""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
import writeback_mlx_backend.plugin as mlx_plugin
import writeback_passes.plugin as passes_plugin
from executorch.exir import ExecutorchProgramManager
from executorch.exir.delegate import executorch_call_delegate
from torch.export import ExportedProgram
from writeback_core import exporting, lowering
from writeback_core.registry import InPlaceDecision, Registry, load_registry
from writeback_mlx_backend import MLXDelegate
from writeback_pybind_runtime import Method, Runtime


def registry(*extra: object) -> Registry:
    """A fresh registry with the MLX backend and the passes plugins (no entry points)."""
    return load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, *extra])


def export_module(module: torch.nn.Module, args: tuple[Any, ...]) -> ExportedProgram:
    """torch.export as the project does (:func:`writeback_core.exporting.export_model`)."""
    return exporting.export_model(module, args)


@dataclass
class Lowered:
    """A module lowered to MLX and to ExecuTorch, with core's in-place decisions."""

    program: ExecutorchProgramManager
    decisions: list[InPlaceDecision]
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
        from writeback_mlx_backend.op_table import op_key

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
    """Export ``module`` and lower it for MLX through core's lowering path.

    With ``passes`` the registered passes run, so write-backs the delegate accepted are
    dropped; without, exir alone. ``planned_inputs`` picks the ``"planned"`` memory plan
    over ``"state"`` (caller-owned state unplanned).
    """
    exported = export_module(module, args)
    key = None if registry_ is not None else (fingerprint(exported), planned_inputs, own_buffers, passes)
    if key is not None and key in _LOWERED:
        # The lowering is shared; the registry (which the runtime's delegates register from) is not.
        return dataclasses.replace(_LOWERED[key], registry=registry())
    reg = registry_ if registry_ is not None else registry()
    spec = reg.backends()["mlx"]
    if not own_buffers:
        factory = spec.partitioner
        spec = dataclasses.replace(spec, partitioner=lambda r: factory(r, own_buffers=False))
    partitioned = lowering.partition(exported, reg, spec)
    manager = lowering.to_executorch(
        partitioned.edge,
        registry=reg,
        plan="planned" if planned_inputs else "state",
        backend=spec.name,
        passes=passes,
        warn_copies=False,
    )
    lowered = Lowered(manager, list(partitioned.decisions.values()), reg)
    if key is not None:
        _LOWERED[key] = lowered
        while len(_LOWERED) > _KEPT:
            del _LOWERED[next(iter(_LOWERED))]
    return lowered


# Lowerings of this worker, by program: tests that lower the same program (same graph, shapes,
# weights and options) with the default registry share one, read-only (``Lowered.method`` loads
# a fresh runtime each time). Lowering is most of an MLX test's time.
_LOWERED: dict[tuple[str, bool, bool, bool], Lowered] = {}
_KEPT = 48


def fingerprint(exported: ExportedProgram) -> str:
    """A digest of everything lowering reads from ``exported``: the graph with every node's
    shape and dtype, the signature, and the bytes of each weight, buffer and constant."""
    digest = hashlib.sha256(str(exported).encode())
    tensors = {**exported.state_dict, **exported.constants}
    for name in sorted(tensors):
        value = tensors[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype}{tuple(value.shape)}{tuple(value.stride())}".encode())
            digest.update(value.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(type(value)).encode())
    return digest.hexdigest()


def count_kernel_calls(monkeypatch: Any, name: str) -> dict[str, Any]:
    """Count calls of ``mlx.core.fast.<name>`` from now on, still calling it: ``{"n": calls,
    "shapes": the array arguments' shapes in the latest call}``."""
    import mlx.core as mx

    calls: dict[str, Any] = {"n": 0, "shapes": []}
    kernel = getattr(mx.fast, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        calls["shapes"] = [tuple(a.shape) for a in args if isinstance(a, mx.array)]
        return kernel(*args, **kwargs)

    monkeypatch.setattr(mx.fast, name, counted)
    return calls
