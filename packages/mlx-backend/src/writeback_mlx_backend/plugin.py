"""Entry-point plugin of writeback-mlx-backend (thin: imports core and torch only).

MLX and the delegate's modules are imported inside the hookimpls, so installing
this package never breaks another package's import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from writeback_core import (
    BackendSpec,
    Mutation,
    MutationKind,
    PartitionView,
    RuntimeDelegate,
    WriteKind,
)
from writeback_core.registry import Registry, hookimpl

from writeback_mlx_backend._names import BACKEND_ID, BACKEND_NAME

if TYPE_CHECKING:
    from torch.export import ExportedProgram

writeback_name = "mlx-backend"

# Writes the delegate can do into memory it shares with the caller: only the
# written region is stored.
_IN_PLACE_WRITES = frozenset({WriteKind.INDEX_COPY, WriteKind.SLICE_SCATTER, WriteKind.INDEX_PUT})


def _partitioner(registry: Registry, **options: Any) -> Any:
    from writeback_mlx_backend.partitioner import MLXPartitioner

    return MLXPartitioner(registry, **options)


@hookimpl
def writeback_backends() -> Sequence[BackendSpec]:
    return [
        BackendSpec(
            name=BACKEND_NAME,
            backend_id=BACKEND_ID,
            partitioner=_partitioner,
            description="MLX delegate; writes KV caches and other state in place",
        )
    ]


@hookimpl
def writeback_accepts_in_place(backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
    if backend != BACKEND_NAME:
        return None
    write = mutation.write
    inside = write.node is not None and partition.contains(write.node)
    if not inside or write.kind not in _IN_PLACE_WRITES:
        return False
    if not mutation.shape:
        return False  # 0-d state: no region to write
    if mutation.kind is MutationKind.BUFFER and mutation.also_returned(partition.graph):
        # The returned value must live outside the buffer's memory: a copy either way.
        return False
    return mutation.kind in (MutationKind.USER_INPUT, MutationKind.BUFFER)


@hookimpl
def writeback_runtime_delegates() -> Sequence[RuntimeDelegate]:
    from writeback_mlx_backend.runtime import MLXDelegate

    return [MLXDelegate()]


def _empty(shape: Sequence[int], dtype: Any) -> Any:
    from writeback_mlx_backend.memory import empty

    return empty(shape, dtype)


@hookimpl
def writeback_state_allocators() -> dict[str, Any]:
    """Caller-owned state allocated in MLX, so the delegate reads and writes it without a copy."""
    return {BACKEND_NAME: _empty}


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    if nbytes < 1 << 20:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


@hookimpl
def writeback_explain_columns(program: ExportedProgram, mutation: Mutation) -> dict[str, str] | None:
    """The "mlx" column: what lowering this state to the MLX backend costs per call."""
    if mutation.write.kind not in _IN_PLACE_WRITES or not mutation.shape:
        return {"mlx": f"copied back, {_size(mutation.nbytes)}/call"}
    if mutation.kind is MutationKind.BUFFER:
        return {"mlx": "delegate-owned, in place"}
    # A plain torch tensor is copied into MLX each call; one from ``empty()`` is not.
    return {"mlx": f"in place; {_size(mutation.nbytes)}/call copy-in unless from empty()"}
