"""Write state in place with a kernel every stock ExecuTorch runtime links, and drop its copy.

exir writes a mutated buffer or user input back whole: ``new = index_put(P, ...)``
computes a full new copy of ``P`` and ``copy_(P, new)`` copies it back, every call.
ExecuTorch 1.5.1's kernel libraries (portable and optimized) link exactly two
in-place kernels that can write into state: ``aten::copy_`` and ``aten::index_put_``
(the special case: one 1-D ``Long``/``Int`` index tensor, values shaped like the
state except along the indexed dim, every index checked to lie in ``[0, size)``
before anything is written). The runtime has no view of a slice, so a write into
a slice cannot be a ``copy_`` into a view; it becomes ``index_put_`` with an
``arange`` index instead (``arange.start_out`` is linked too). This pass turns
each functional state write into that one kernel:

========================================  =================================================
functional write (edge dialect)           in-place form
========================================  =================================================
``index_put(P, [None, .., i], v)``        ``index_put_(P, [None, .., i], v')``
``index_copy(P, d, i, v)``                ``index_put_(P, [None] * d + [i], v)``
``slice_scatter(P, v, d, a, b, s)``       ``index_put_(P, [None] * d + [arange(a, b, s)], v)``
``select_scatter(P, v, d, k)``            ``index_put_(P, [None] * d + [arange(k, k+1)], v'')``
========================================  =================================================

A negative ``i`` of ``index_put`` is wrapped first (``where(i < 0, i + size, i)``), as
eager wraps it. ``v'`` is ``v`` reshaped (a view once exir replaces view copies) or broadcast
(``expand_copy``, the size of the write) to the shape the kernel requires; ``v''``
is ``v`` with the selected dim put back as size 1. A ``copy_`` into a slice or a
``narrow`` is a ``slice_scatter`` by the time exir sees it. Each ``aten.index_put``
has 1-D index ``i``; ``index_put`` with several index tensors, a boolean mask,
``accumulate``, or a full overwrite has no in-place kernel and keeps its copy.

This module holds the pass, its report and its registration (:func:`state_writes_pass`);
the planning of each write is in :mod:`writeback_passes.state_write_plans`, the refusal rule
(:func:`~writeback_passes.state_write_refusals.in_place_kernel_refusal`) in
:mod:`writeback_passes.state_write_refusals`, the graph rewrite in
:mod:`writeback_passes.state_write_rewrite`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import ProgramPass
from writeback_core.ops import write_back_copies
from writeback_core.registry import InPlaceDecision

from writeback_passes.graph import StorageAliases
from writeback_passes.state_write_plans import Write
from writeback_passes.state_write_refusals import peel_copy, plan_state_write
from writeback_passes.state_write_rewrite import fake_mode, guard_index_copies, rewrite_in_place

__all__ = [
    "KeptStateWrite",
    "ReinplacedStateWrite",
    "StateWriteReport",
    "reinplace_state_writes",
    "state_writes_pass",
]


@dataclass(frozen=True)
class ReinplacedStateWrite:
    """A state written in place: ``writes`` (functional write nodes) became ``index_put_``."""

    placeholder: str
    writes: tuple[str, ...]


@dataclass(frozen=True)
class KeptStateWrite:
    """The write-back of an accepted state write that had to stay, and why."""

    placeholder: str
    reason: str


@dataclass
class StateWriteReport:
    """What :func:`reinplace_state_writes` did to one graph (usable as an exir ``PassResult``)."""

    graph_module: torch.fx.GraphModule
    reinplaced: list[ReinplacedStateWrite] = field(default_factory=list)
    kept: list[KeptStateWrite] = field(default_factory=list)
    guarded: list[str] = field(default_factory=list)  # decomposed index_copy nodes made to reject negatives

    @property
    def modified(self) -> bool:
        return bool(self.reinplaced or self.guarded)


def reinplace_state_writes(program: ExportedProgram | torch.fx.GraphModule) -> StateWriteReport:
    """Make accepted state writes in place with ``index_put_`` and drop their write-backs.

    Runs after exir inserted its write-backs (``to_executorch``'s
    ``before_memory_planning`` stage), before early write-back. Algorithm, per
    write-back ``copy_(P, value)`` where ``P`` is a mutable buffer or a mutated
    user input:

    1. Skip unless core recorded on ``P`` an accepted in-place decision
       (``writeback_accepts_in_place``, answered for the ``portable`` and
       ``xnnpack`` backends with
       :func:`~writeback_passes.state_write_refusals.in_place_kernel_refusal`).
    2. Peel functional ``aten.copy(P, x)`` nodes; follow ``value``'s first
       argument down to ``P`` through writes of the table in the module
       docstring (several writes into one state chain). Anything else keeps
       the copy.
    3. Refuse (keep the copy, report why) when a node after a write reads the
       value that write overwrites (``P`` or an earlier write of the chain)
       through any alias, ``view_copy`` included (exir turns those into views
       later); when the values or index of a write may share ``P``'s storage
       (the write would overlap what it reads); when ``P`` was consumed into a
       delegate as constant data.
    4. Otherwise insert, before each write, its index (an existing tensor, or
       ``arange``) and its values' reshape or broadcast, replace the write by
       ``index_put_`` into the previous one (``P`` for the first), point every
       reader at it and replace the copy by the last in-place node. Indices
       read as eager reads them: ``index_put``'s index gets
       ``where(i < 0, i + size, i)`` first (eager wraps a negative position; a
       decomposed ``index_copy`` does not, as eager's rejects one); constant
       slice bounds are wrapped and clamped here; a slice bound known only at
       run time is written in place only where the program proves it lies in
       ``[0, size]``. Beyond that nothing is assumed: the kernel checks every
       index before it writes (measured on ExecuTorch 1.5.1's portable
       library), and an index eager rejects fails the call with the state
       unchanged.
    5. Every functional ``index_put`` left that is a decomposed ``index_copy``
       (a copy kept, or no state at all) gets ``where(i < 0, i - size, i)``:
       its ``index_put.out`` kernel would wrap a negative index that eager's
       ``index_copy`` rejects; moved below ``-size``, the kernel rejects it too.

    Example it must refuse::

        new = index_put(cache, [None, None, pos], v)   # the write
        y = cache.sum()                                # reads the OLD cache
        cache.copy_(new)                               # the write-back

    :return: the states written in place and the accepted ones kept, with reasons.
    """
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    graph = gm.graph
    report = StateWriteReport(gm)
    copies = [c for c in write_back_copies(graph) if _accepted(c)]
    if copies:
        _reinplace(graph, copies, report)
    report.guarded.extend(guard_index_copies(graph))
    if report.modified:
        graph.lint()
        gm.recompile()
    return report


def _reinplace(graph: torch.fx.Graph, copies: Sequence[torch.fx.Node], report: StateWriteReport) -> None:
    storage = StorageAliases(graph)
    plans: list[tuple[torch.fx.Node, torch.fx.Node, list[Write], list[torch.fx.Node]]] = []
    for copy in copies:
        placeholder = copy.args[0]
        assert isinstance(placeholder, torch.fx.Node)
        value, peeled = peel_copy(copy.args[1], placeholder)
        planned = plan_state_write(graph, placeholder, value, ignored={copy, *peeled}, storage=storage)
        if isinstance(planned, str):
            report.kept.append(KeptStateWrite(placeholder.name, planned))
            continue
        plans.append((copy, placeholder, planned, peeled))
    fake = fake_mode(graph)
    for copy, placeholder, writes, peeled in plans:
        last = rewrite_in_place(graph, writes, placeholder, fake)
        copy.replace_all_uses_with(last)
        graph.erase_node(copy)
        for node in reversed(peeled):
            if not node.users:
                graph.erase_node(node)
        report.reinplaced.append(ReinplacedStateWrite(placeholder.name, tuple(w.node.name for w in writes)))


def _accepted(copy: torch.fx.Node) -> bool:
    placeholder = copy.args[0]
    decision = InPlaceDecision.from_node(placeholder) if isinstance(placeholder, torch.fx.Node) else None
    return decision is not None and decision.accepted


def state_writes_pass() -> ProgramPass:
    """This pass as a ``"before_memory_planning"`` :class:`~writeback_core.ProgramPass`, after
    the write-backs a delegate takes are dropped; early write-back, which must see the
    write-backs that remain, runs after it."""
    from writeback_passes.backend_names import STOCK_RUNTIME

    return ProgramPass(
        name="reinplace_state_writes",
        stage="before_memory_planning",
        run=reinplace_state_writes,
        after=("reinplace_delegate_input_mutations",),
        backends=STOCK_RUNTIME,
        reason="state written in place by the stock index_put_ kernel",
    )
