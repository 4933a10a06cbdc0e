"""Entry-point plugin of writeback-mlx-backend (thin: imports core and torch only).

MLX and the delegate's modules are imported inside the hookimpls, so installing
this package never breaks another package's import.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx
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
    from executorch.exir import ExecutorchProgramManager
    from torch.export import ExportedProgram

writeback_name = "mlx-backend"

# Writes the delegate can do into memory it shares with the caller: only the
# written region is stored, or, for a full write, the new value after every output
# of the call is evaluated (as a delegate-owned buffer is replaced).
_IN_PLACE_WRITES = frozenset({WriteKind.INDEX_COPY, WriteKind.SLICE_SCATTER, WriteKind.INDEX_PUT, WriteKind.FULL})
# The writes the delegate leaves to a copy, in words.
_WRITE_WORDS = {
    WriteKind.MUTATING_OP: "a write by an op that mutates its argument",
    WriteKind.OTHER: "a partial write of a form writeback does not recognise",
}


def _partitioner(registry: Registry, **options: Any) -> Any:
    from writeback_mlx_backend.partitioner import MLXPartitioner

    # The partitioner only tags; core wraps it and records the per-mutation decisions.
    return MLXPartitioner(**options)


@hookimpl
def writeback_backends() -> Sequence[BackendSpec]:
    return [
        BackendSpec(
            name=BACKEND_NAME,
            backend_id=BACKEND_ID,
            partitioner=_partitioner,
            description="MLX delegate; writes KV caches and other state in place",
            # the backend writeback was first built around: the default where it is installed
            preferred=True,
        )
    ]


def in_place_refusal(partition: PartitionView, mutation: Mutation) -> str | None:
    """Why the MLX delegate does not write ``mutation`` in place, or ``None`` when it does.

    The one rule of this backend: ``writeback_accepts_in_place`` answers with
    it while partitioning, and the ``writeback explain`` column states it.
    """
    write = mutation.write
    if write.node is None or not partition.contains(write.node):
        return "the write runs outside the MLX delegate"
    if not partition.contains(mutation.value):
        # The partition that would write in place must be the one returning the new
        # value: the write-back dropped is of that value.
        return "its new value is produced outside this MLX partition"
    if write.kind not in _IN_PLACE_WRITES:
        words = _WRITE_WORDS.get(write.kind, write.kind.value)
        return f"its write, {words} ({write.describe()}), is not one the delegate does in place"
    if write.kind is WriteKind.FULL and not _reads(partition, mutation.placeholder):
        # The delegate is handed only what it reads: a state it replaces without reading
        # it never reaches it, so its new value can only be copied back.
        return "the partition replacing it does not read it, so it is not passed the state"
    if not mutation.shape:
        return "0-d state has no region to write"
    if mutation.kind is MutationKind.BUFFER and mutation.also_returned(partition.graph):
        return "its new value is also returned, which must live outside the buffer"
    return None


def _reads(partition: PartitionView, placeholder: str) -> bool:
    """Whether a node of ``partition`` reads the placeholder named ``placeholder``."""
    found = next((n for n in partition.graph.nodes if n.op == "placeholder" and n.name == placeholder), None)
    return found is not None and any(partition.contains(user) for user in found.users)


@hookimpl
def writeback_accepts_in_place(backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
    if backend != BACKEND_NAME:
        return None
    return in_place_refusal(partition, mutation) is None


@hookimpl
def writeback_runtime_delegates() -> Sequence[RuntimeDelegate]:
    from writeback_mlx_backend.mlx_delegate import MLXDelegate

    return [MLXDelegate()]


def _empty(shape: Sequence[int], dtype: Any) -> Any:
    from writeback_mlx_backend.allocations import empty

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


@dataclass(frozen=True)
class _Plan:
    """The partitions MLX's partitioner would make of a program's decomposed graph."""

    graph: torch.fx.Graph
    tags: dict[str, str]  # operator node name -> partition tag
    owned: dict[str, str]  # placeholder of a delegate-owned buffer -> its partition's tag

    def view(self, node: str | None) -> PartitionView:
        """The partition taking ``node`` (empty when none does)."""
        tag = self.tags.get(node) if node is not None else None
        members = frozenset(n for n, t in self.tags.items() if tag is not None and t == tag)
        return PartitionView(BACKEND_NAME, members, self.graph)


def _plan(program: ExportedProgram) -> _Plan:
    """What the MLX partitioner makes of ``program``'s shared decomposition (the program
    explain's mutations were found in)."""
    plan = _PLANS.get(program)
    if plan is None:
        from writeback_core.program_passes import decomposed

        from writeback_mlx_backend.partitioner import owned_buffers, propose_tags

        aten = decomposed(program)
        tags = propose_tags(aten.graph_module)
        owned = owned_buffers(aten, lambda node: tags.get(node.name))
        plan = _PLANS[program] = _Plan(aten.graph_module.graph, tags, owned)
    return plan


# explain asks once per mutation row; the program is decomposed and partitioned once.
_PLANS: weakref.WeakKeyDictionary[ExportedProgram, _Plan] = weakref.WeakKeyDictionary()


@hookimpl
def writeback_explain_columns(program: ExportedProgram, mutation: Mutation) -> dict[str, str] | None:
    """The "mlx" column: what lowering this state to the MLX backend costs per call.

    Worked out on the partitions MLX's partitioner makes of the shared decomposition the
    row's mutation was found in (``writeback_core.program_passes.decomposed``): a buffer one
    partition reads and produces is delegate-owned (:func:`~writeback_mlx_backend.partitioner.owned_buffers`);
    a buffer an op declared to write it writes (``Mutation.written_by_op``) is written in place
    by that op on the runtime; any other state is decided by :func:`in_place_refusal`, the
    rule ``writeback_accepts_in_place`` answers with, over the partition taking its write.
    """
    plan = _plan(program)
    if mutation.kind is MutationKind.BUFFER and mutation.placeholder in plan.owned:
        return {"mlx": "delegate-owned, in place"}
    if mutation.written_by_op is not None:
        # An op no MLX partition takes, run by the runtime on the program's buffer.
        return {"mlx": f"in place by {mutation.written_by_op} outside the delegate, 0 B/call"}
    write = mutation.write.node
    refusal = in_place_refusal(plan.view(write), mutation)
    if refusal is not None:
        return {"mlx": f"copied back, {_size(mutation.nbytes)}/call: {refusal}"}
    if mutation.kind is MutationKind.BUFFER:
        # Read by another partition (or an op outside): the program keeps it and the
        # partition producing its new value writes it there.
        return {"mlx": "program buffer (read outside its writing partition), written in place"}
    # A plain torch tensor is copied into MLX each call; one from ``empty()`` is not.
    return {"mlx": f"in place; {_size(mutation.nbytes)}/call copy-in unless from empty()"}


@hookimpl
def writeback_explain_notes(registry: Registry, lower: Callable[[str], ExecutorchProgramManager]) -> list[str] | None:
    """How the MLX delegate would execute ``program``: each partition's execution path.

    The program is lowered as ``writeback run --backend mlx`` lowers it and each
    partition's blob is loaded in a delegate made for the purpose (weights included),
    so the path is the one a run gets: compiled (with its attention windows) or
    interpreted, and why.
    """
    from executorch.exir.delegate import executorch_call_delegate

    from writeback_mlx_backend.mlx_delegate import MLXDelegate

    backend = registry.backends().get(BACKEND_NAME)
    if backend is None:
        return None
    try:
        lowered = lower(BACKEND_NAME)
    except Exception as error:  # explain still prints the table; this line says why not
        return [f"mlx execution: the program does not lower to MLX ({type(error).__name__}: {error})"]
    module = lowered.exported_program().graph_module
    calls = [n for n in module.graph.nodes if n.target is executorch_call_delegate]
    blobs = [getattr(module, str(n.args[0].target)) for n in calls]
    blobs = [b for b in blobs if b.backend_id == BACKEND_ID]
    if not blobs:
        return ["mlx execution: no part of the program runs in the MLX delegate"]
    lines = []
    delegate = MLXDelegate()
    for number, blob in enumerate(blobs, start=1):
        specs = {spec.key: spec.value for spec in blob.compile_specs}
        try:
            handle = delegate.init(bytes(blob.processed_bytes), specs)
        except Exception as error:
            lines.append(f"mlx execution, partition {number} of {len(blobs)}: fails to load: {error}")
            continue
        ops = len(handle.steps)
        lines.append(f"mlx execution, partition {number} of {len(blobs)} ({ops} ops): {MLXDelegate.path(handle)}")
        delegate.destroy(handle)
    return lines
