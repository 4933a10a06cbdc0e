"""Entry-point module of the example backend: thin, imports core and torch only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from writeback_core import (
    BackendSpec,
    Mutation,
    PartitionView,
    RuntimeDelegate,
    WriteKind,
    hookimpl,
)

from writeback_example_backend import BACKEND_ID, BACKEND_NAME

writeback_name = "example-backend"


def _partitioner(registry: Any, **options: Any) -> Any:
    from writeback_example_backend.backend import ExamplePartitioner

    return ExamplePartitioner(registry, **options)


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
def writeback_accepts_in_place(
    backend: str, partition: PartitionView, mutation: Mutation
) -> bool | None:
    if backend != BACKEND_NAME:
        return None
    write = mutation.write
    return write.kind is WriteKind.INDEX_COPY and write.node is not None and partition.contains(
        write.node
    )


@hookimpl
def writeback_runtime_delegates() -> Sequence[RuntimeDelegate]:
    from writeback_example_backend.backend import ExampleRuntimeDelegate

    return [ExampleRuntimeDelegate()]
