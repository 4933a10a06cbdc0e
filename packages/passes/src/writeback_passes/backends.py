"""The ``portable`` and ``xnnpack`` backends: programs the stock ExecuTorch runtime runs as
shipped, with their state written in place by :mod:`writeback_passes.reinplace_state_writes`.

``portable`` lowers no delegate: every operator runs on the kernels the stock runtime
links. ``xnnpack`` is ExecuTorch's own ``XnnpackPartitioner``, unchanged. XNNPACK never
writes a state in place inside its delegate (its runtime has no write into a graph
input), so every state write it computes keeps its copy; the writes that run on the
kernels outside it are made in place when :func:`in_place_kernel_refusal
<writeback_passes.state_write_refusals.in_place_kernel_refusal>` allows: after the
delegate's last read of the old value, and never into a state consumed into the
delegate as constant data.
"""

from __future__ import annotations

from typing import Any

from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from torch.export import ExportedProgram

__all__ = ["NoDelegatePartitioner", "xnnpack_partitioner"]


class NoDelegatePartitioner(Partitioner):  # type: ignore[misc]  # executorch is untyped: its bases are Any
    """Tags nothing: every operator stays on the stock runtime's kernels."""

    def __init__(self) -> None:
        super().__init__(DelegationSpec("NoDelegate", []))

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        """Return the program untagged."""
        return PartitionResult(tagged_exported_program=exported_program, partition_tags={})


def xnnpack_partitioner(**options: Any) -> Partitioner:
    """ExecuTorch's ``XnnpackPartitioner`` with ``options``.

    Also imports ExecuTorch's stock Python bindings: they link the XNNPACK runtime
    backend and register it in the backend registry of ``libexecutorch.so``, which
    every runtime of the process shares (writeback's pybind runtime among them), so
    a program lowered here loads in either runtime of this process.
    """
    import executorch.extension.pybindings.portable_lib  # noqa: F401  # registers XnnpackBackend
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    partitioner: Partitioner = XnnpackPartitioner(**options)
    return partitioner
