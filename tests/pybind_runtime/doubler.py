"""A test Python delegate that doubles a tensor, lowered with a real exir partitioner.

``DoublerBackend`` is the exir side (its class name is the backend id the
``.pte`` carries); ``DoublerPartitioner`` hands every ``x + x`` to it; and
``DoublerDelegate`` is the runtime side a plugin offers through
``writeback_runtime_delegates``: it writes ``2 * input`` into the output view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, final

import torch
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram
from writeback_core.registry import hookimpl

BACKEND_ID = "WritebackTestDoublerBackend"
BLOB = b"doubler-v1"


@final
class WritebackTestDoublerBackend(BackendDetails):
    """exir side: the processed blob is a fixed marker the delegate checks in init()."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        return PreprocessResult(processed_bytes=BLOB)


class DoublerPartitioner(Partitioner):
    """Tags each ``add(x, x)`` node as its own partition for the doubler backend."""

    def __init__(self) -> None:
        super().__init__()
        self.delegation_spec = DelegationSpec(BACKEND_ID, [CompileSpec("factor", b"2")])

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        tags: dict[str, DelegationSpec] = {}
        for node in exported_program.graph_module.graph.nodes:
            if (
                node.op == "call_function"
                and node.target == exir_ops.edge.aten.add.Tensor
                and node.args[0] is node.args[1]
            ):
                tag = f"doubler_{len(tags)}"
                node.meta["delegation_tag"] = tag
                tags[tag] = self.delegation_spec
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


class DoublerDelegate:
    """Runtime side: ``execute(handle, [x, out])`` writes ``factor * x`` into ``out``.

    Records every call so tests can check what crossed the boundary.
    """

    backend_id = BACKEND_ID

    def __init__(self, fail_with: BaseException | None = None) -> None:
        self.fail_with = fail_with
        self.inits: list[tuple[bytes, dict[str, bytes]]] = []
        self.calls: list[list[Any]] = []
        self.destroyed: list[Any] = []

    def init(self, processed: bytes, compile_specs: Mapping[str, bytes]) -> Any:
        if processed != BLOB:
            raise ValueError(f"unexpected blob {processed!r}")
        self.inits.append((processed, dict(compile_specs)))
        return {"factor": float(compile_specs["factor"].decode())}

    def execute(self, handle: Any, args: Sequence[Any]) -> None:
        self.calls.append(list(args))
        if self.fail_with is not None:
            raise self.fail_with
        x, out = args
        torch.mul(x, handle["factor"], out=out)

    def destroy(self, handle: Any) -> None:
        self.destroyed.append(handle)


class DoublerPlugin:
    """A plugin offering one delegate through the real hook."""

    writeback_name = "test-doubler"

    def __init__(self, delegate: DoublerDelegate) -> None:
        self.delegate = delegate

    @hookimpl
    def writeback_runtime_delegates(self) -> list[DoublerDelegate]:
        return [self.delegate]
