"""Entry-point module of the example backend: thin, imports core and torch only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from writeback_core import (
    BackendSpec,
    Mutation,
    MutationKind,
    PartitionView,
    Registry,
    RuntimeDelegate,
    WriteKind,
    hookimpl,
)

from writeback_example_backend import BACKEND_ID, BACKEND_NAME

writeback_name = "example-backend"


def _partitioner(registry: Registry, **options: Any) -> Any:
    # exir is imported here, not at the top: loading this plugin stays cheap.
    from writeback_example_backend.backend import ExamplePartitioner

    # Our partitioner only tags nodes; core wraps it and records the per-mutation decisions.
    return ExamplePartitioner(**options)


@hookimpl
def writeback_backends() -> Sequence[BackendSpec]:
    return [
        BackendSpec(
            name=BACKEND_NAME,
            backend_id=BACKEND_ID,
            partitioner=_partitioner,
            description="example third-party backend: in-place one-slot cache writes",
        )
    ]


@hookimpl
def writeback_accepts_in_place(backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
    if backend != BACKEND_NAME:
        return None
    write = mutation.write
    if write.kind is not WriteKind.INDEX_COPY or write.node is None:
        return False
    if mutation.kind is MutationKind.BUFFER and mutation.also_returned(partition.graph):
        # A buffer is planned memory; the value the caller gets back must live
        # elsewhere, so a copy is needed either way: keep exir's write-back.
        return False
    return partition.contains(write.node)


@hookimpl
def writeback_runtime_delegates() -> Sequence[RuntimeDelegate]:
    from writeback_example_backend.backend import ExampleRuntimeDelegate

    return [ExampleRuntimeDelegate()]
