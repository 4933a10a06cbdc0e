"""Entry-point plugin of writeback-passes (thin: imports core and torch only).

The passes themselves live in sibling modules imported inside the hookimpls,
so loading the plugin costs nothing until a pipeline asks for a pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from writeback_core import BackendSpec, MutationKind, ProgramPass, Stage, hookimpl

# The backend names are the passes' own (each pass names the backends it serves); re-exported here.
from writeback_passes.backend_names import KERNEL_BACKENDS as KERNEL_BACKENDS
from writeback_passes.backend_names import PORTABLE as PORTABLE
from writeback_passes.backend_names import STOCK_RUNTIME as STOCK_RUNTIME
from writeback_passes.backend_names import XNNPACK as XNNPACK

if TYPE_CHECKING:
    from torch.export import ExportedProgram
    from writeback_core import Mutation, PartitionView, Registry

writeback_name = "passes"


def _portable(registry: Registry, **options: Any) -> Any:
    from writeback_passes.backends import NoDelegatePartitioner

    return NoDelegatePartitioner()


def _xnnpack(registry: Registry, **options: Any) -> Any:
    from writeback_passes.backends import xnnpack_partitioner

    return xnnpack_partitioner(**options)


@contextmanager
def _xnnpack_lowering() -> Iterator[None]:
    from writeback_passes.partition_merging import merge_checked_by_sets
    from writeback_passes.xnnpack_preprocess import xnnpack_passes_pruned

    with merge_checked_by_sets(), xnnpack_passes_pruned():
        yield


@hookimpl
def writeback_backends() -> Sequence[BackendSpec]:
    """``portable`` (no delegate) and ``xnnpack`` (ExecuTorch's ``XnnpackPartitioner``), both
    with their state written in place by the stock runtime's ``index_put_`` kernel."""
    return [
        BackendSpec(
            name=PORTABLE,
            backend_id="",
            partitioner=_portable,
            description="no delegate: the stock runtime's kernels; state written in place by index_put_",
            kernel_writes=True,
            dynamic_shapes=True,
        ),
        BackendSpec(
            name=XNNPACK,
            backend_id="XnnpackBackend",
            partitioner=_xnnpack,
            description="ExecuTorch's XNNPACK delegate; state written in place outside it by index_put_",
            kernel_writes=True,
            dynamic_shapes=True,
            lowering_context=_xnnpack_lowering,
            single_decomposition=True,
        ),
    ]


@hookimpl
def writeback_accepts_in_place(backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
    """For ``portable`` and ``xnnpack``: never a buffer whose new value is also returned; inside
    an XNNPACK partition, a buffer rewritten whole (``whole_state_writes`` plans the delegate's
    result onto the buffer where the delegated graph makes that exact), no other write; on the
    kernels outside every partition, a state rewritten whole always (``whole_state_writes``
    decides on the final kernels), a write at positions when ``in_place_kernel_refusal`` finds
    nothing against it."""
    if backend not in KERNEL_BACKENDS:
        return None
    if mutation.kind is MutationKind.BUFFER and mutation.also_returned(partition.graph):
        return False
    if not partition.kernels:
        # XNNPACK writes its results where the runtime points it: a buffer rewritten whole may
        # have its new value planned onto its own memory. whole_state_writes decides on the
        # delegated graph (whether any operator reads the old value once it is written).
        return backend == XNNPACK and mutation.kind is MutationKind.BUFFER and _rewritten_whole(mutation)
    from writeback_passes.state_write_refusals import in_place_kernel_refusal

    if _rewritten_whole(mutation):
        # whole_state_writes hands the state to the kernel computing its new value where the
        # final kernels make that exact, and names the copy it keeps, and why, otherwise.
        return True
    return in_place_kernel_refusal(partition.graph, mutation.placeholder, mutation.value) is None


def _rewritten_whole(mutation: Mutation) -> bool:
    """Whether ``mutation`` may replace every element of its state each call: a full write, a
    slice write covering the whole dim (``state[:batch].copy_(new)`` with ``batch`` the size),
    or a chain of writes of no one form (ExecuTorch's Qwen3.5 resets ``state[:batch]`` by
    ``mul_`` and then copies into it). ``whole_state_writes`` checks the final kernels itself."""
    from writeback_core.mutations import WriteKind

    write = mutation.write
    if write.kind in (WriteKind.FULL, WriteKind.OTHER):
        return True
    if write.kind is not WriteKind.SLICE_SCATTER or write.dim is None or write.dim >= len(mutation.shape):
        return False
    return write.start == 0 and write.end == mutation.shape[write.dim] and write.step in (None, 1)


@hookimpl
def writeback_program_passes(stage: Stage) -> Sequence[ProgramPass]:
    """The package's passes; each says the backends it serves (the stock runtime's lowerings,
    :data:`STOCK_RUNTIME`, or every backend), why, and by name what it runs after or before.

    At ``"exported"``: a static cache's causal attention moved onto the LLM runner's
    kernels, then attention bounded to the keys its mask opens. At
    ``"before_partition"``: reshape-only copies made views, then each scalar multiply of a
    ``bmm`` operand moved to the smaller one. At ``"before_memory_planning"``: dropping
    write-backs a delegate takes in place, then writing state in place with the stock
    runtime's kernels, then making reshape-only copies views, then early write-back (after
    those graph edits), then every run-time index checked before the first state write
    (a refused call changes nothing), then the caller's tokens and positions checked against the
    runner's contract before any kernel reads them. At ``"after_out_variants"``: a state
    rewritten whole written into its own memory by the kernel that computes it."""
    if stage == "exported":
        from writeback_passes.bounded_attention import bound_attention_pass
        from writeback_passes.runner_attention import runner_attention_pass

        return (runner_attention_pass(), bound_attention_pass())
    if stage == "before_partition":
        from writeback_passes.smaller_operand_scaling import scale_smaller_operand_pass
        from writeback_passes.view_copies import functional_copies_as_views_pass

        return (functional_copies_as_views_pass(), scale_smaller_operand_pass())
    if stage == "after_out_variants":
        from writeback_passes.whole_state_writes import whole_state_writes_pass

        return (whole_state_writes_pass(),)
    if stage != "before_memory_planning":
        return ()
    from writeback_passes.early_write_back import early_write_back_pass
    from writeback_passes.index_checks import index_checks_pass
    from writeback_passes.input_checks import runner_input_checks_pass
    from writeback_passes.reinplace_delegate import reinplace_delegate_pass
    from writeback_passes.reinplace_state_writes import state_writes_pass
    from writeback_passes.view_copies import copies_as_views_pass

    return (
        reinplace_delegate_pass(),
        state_writes_pass(),
        copies_as_views_pass(),
        early_write_back_pass(),
        index_checks_pass(),
        runner_input_checks_pass(),
    )


@hookimpl
def writeback_explain_columns(program: ExportedProgram, mutation: Mutation) -> dict[str, str] | None:
    """The "early write-back" column (where this pass puts the copy, and the lifetime it
    saves) and the "stock kernels" column (what ``--backend portable``/``xnnpack`` do)."""
    from writeback_passes.explain_columns import early_write_back_columns, stock_kernel_columns

    return {**early_write_back_columns(program, mutation), **stock_kernel_columns(program, mutation)}
