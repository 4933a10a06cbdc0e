"""Check every run-time index before the first state write, so a refused call changes nothing.

Stock ExecuTorch writes state back at the end of the graph: a kernel that refuses an
index (``index_put``, ``index``, ...: error 0x12) stops the call before any state is
touched. writeback writes state in place where the value is made (``index_put_``, an
early ``copy_``, a delegate writing its input), so a refusal later in the graph would
leave the writes before it done: a partial update eager's caller never sees from the
stock runtime. This pass restores "refused means unchanged":

1. Find the first node that may write state: an in-place aten op (``copy_``,
   ``index_put_``) or a delegate call.
2. For every later node that reads an index tensor at run time (``index_put``,
   ``index_put_``, ``index.Tensor``, ``index_select``, ``embedding``, ``gather``),
   take the index ``i`` and the size of the dim it indexes, and whether the kernel
   wraps a negative ``i`` (functional ``index_put``, ``index``) or rejects it (in-place
   ``index_put_`` and the rest). An index the passes already wrapped
   (``where(i < 0, i + size, i)``) or guarded for ``index_copy`` (``where(i < 0, i -
   size, i)``) is read through to ``i`` with that meaning. An ``arange`` of constant
   bounds inside the dim needs no check, nor does an index that holds positions along a dim
   no longer than the one it indexes by construction (``topk``'s or ``sort``'s indices,
   ``argmax``, read through ops that only move values: a router's expert ids).
3. Move the pure nodes that compute ``i`` (never a read of state that is written in
   place, never a delegate output) to just after what they read (before that first
   write, and a write-back placed right after its value stays there), and put there
   ``checked = arange(size)[i]``: the ``index.Tensor`` kernel rejects an ``i`` outside
   ``[-size, size)`` (an ``index_copy``'s or a reject-negative op's ``i`` moved below
   ``-size`` first) before anything is written, and otherwise returns ``i`` wrapped,
   which the node then reads in place of its index. One check per index and size.

An index computed from a value that only exists after a write (a delegate output, a
state read after its in-place write) cannot be checked earlier; the report lists it
(``unchecked``) with the reason and warns (:class:`UncheckedIndexWarning`, once per
program): a refusal there may leave earlier writes done.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import ProgramPass
from writeback_core.ops import SAME_VALUES, aten_op, node_value, packet_name

__all__ = [
    "IndexCheckReport",
    "UncheckedIndex",
    "UncheckedIndexWarning",
    "check_indices_first",
    "index_checks_pass",
]

_INDEX_DTYPES = (torch.int64, torch.int32)

# Ops whose kernel reads an index tensor and refuses one out of range, and whether a
# negative index counts from the end (``wrap``) or is refused (``reject``), as eager reads it.
# The kernels' own reading, measured on ExecuTorch 1.5.1's portable library: the functional
# ``index_put.out`` and ``index.Tensor_out`` wrap a negative index; the in-place ``index_put_``
# rejects one (the passes wrap its index first where eager wraps, a pattern read through below).
_WRAPS = frozenset({"index_put", "index"})
_REJECTS = frozenset({"index_put_", "index_select", "embedding", "gather"})


class UncheckedIndexWarning(UserWarning):
    """An index read after a state write could not be checked before it: if the runtime
    refuses that index, the writes before it stay done."""


@dataclass(frozen=True)
class UncheckedIndex:
    """An index read after the first state write whose check could not be moved before it."""

    node: str
    index: str
    reason: str


@dataclass
class IndexCheckReport:
    """What :func:`check_indices_first` did (usable as an exir ``PassResult``)."""

    graph_module: torch.fx.GraphModule
    first_write: str | None = None
    checked: list[str] = field(default_factory=list)  # the nodes whose index now reads a check
    moved: list[str] = field(default_factory=list)  # index computations moved before the first write
    unchecked: list[UncheckedIndex] = field(default_factory=list)

    @property
    def modified(self) -> bool:
        return bool(self.checked)


@dataclass(frozen=True)
class _Use:
    """One index argument of a refusing node: where it sits, what it indexes, how it reads."""

    node: torch.fx.Node
    slot: tuple[int, int | None]  # (argument position, list position or None)
    index: torch.fx.Node  # the raw index, wraps and guards read through
    size: int
    negatives: str  # "wrap" or "reject"


def edge_op(name: str) -> Any:
    from executorch.exir.dialects._ops import ops as exir_ops

    packet, overload = name.split(".")
    return getattr(getattr(exir_ops.edge.aten, packet), overload)


def _is_delegate_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "executorch_call_delegate"


def _writes(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write memory it did not allocate: a mutating aten op or a delegate call."""
    if _is_delegate_call(node):
        return True
    op = aten_op(node.target)
    return node.op == "call_function" and isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable


def _unwrap(index: torch.fx.Node, size: int) -> tuple[torch.fx.Node, str] | None:
    """``(i, meaning)`` when ``index`` is ``where(i < 0, i + size, i)`` (``"wrap"``) or
    ``where(i < 0, i - size, i)`` (``"reject"``) as the passes write them; else None."""
    if packet_name(index.target) != "where" or len(index.args) != 3:
        return None
    negative, shifted, raw = index.args
    if not all(isinstance(n, torch.fx.Node) for n in (negative, shifted, raw)):
        return None
    assert isinstance(negative, torch.fx.Node) and isinstance(shifted, torch.fx.Node)
    assert isinstance(raw, torch.fx.Node)
    if packet_name(negative.target) != "lt" or tuple(negative.args) != (raw, 0):
        return None
    if packet_name(shifted.target) != "add" or len(shifted.args) != 2 or shifted.args[0] is not raw:
        return None
    if shifted.args[1] == size:
        return raw, "wrap"
    if shifted.args[1] == -size:
        return raw, "reject"
    return None


def _index_uses(node: torch.fx.Node) -> Iterator[_Use]:
    """The integer index tensors ``node`` reads, with the size of the dim each indexes."""
    packet = packet_name(node.target)
    source = node_value(node.args[0]) if node.args else None
    if packet not in _WRAPS | _REJECTS or not isinstance(source, torch.Tensor):
        return
    candidates: list[tuple[tuple[int, int | None], object, int]] = []
    listed = packet in ("index_put", "index_put_", "index")
    if listed and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)):
        candidates = [((1, k), i, k) for k, i in enumerate(node.args[1])]
    elif packet == "index_select" and len(node.args) > 2 and isinstance(node.args[1], int):
        candidates = [((2, None), node.args[2], node.args[1])]
    elif packet == "gather" and len(node.args) > 2 and isinstance(node.args[1], int):
        candidates = [((2, None), node.args[2], node.args[1])]
    elif packet == "embedding" and len(node.args) > 1:
        candidates = [((1, None), node.args[1], 0)]
    for slot, index, dim in candidates:
        value = node_value(index)
        if not isinstance(index, torch.fx.Node) or not isinstance(value, torch.Tensor):
            continue
        if value.dtype not in _INDEX_DTYPES or not -source.dim() <= dim < source.dim():
            continue
        size = source.shape[dim]
        if not isinstance(size, int):
            continue
        if _constant_in_range(index, size) or _in_range_by_construction(index, size):
            continue  # nothing to check at run time
        negatives = "wrap" if packet in _WRAPS else "reject"
        unwrapped = _unwrap(index, size)
        if unwrapped is not None:
            index, negatives = unwrapped
        yield _Use(node, slot, index, size, negatives)


def _constant_in_range(index: torch.fx.Node, size: int) -> bool:
    """Whether ``index`` is an ``arange`` of constant bounds whose every value lies in ``[0, size)``."""
    if packet_name(index.target) != "arange" or index.kwargs.get("dtype", torch.int64) not in _INDEX_DTYPES:
        return False
    bounds = list(index.args)
    if len(bounds) == 1:
        bounds = [0, bounds[0]]
    if len(bounds) == 2:
        bounds.append(1)
    if len(bounds) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in bounds):
        return False
    start, end, step = (int(v) for v in bounds)  # type: ignore[arg-type]  # ints, checked above
    if step <= 0:
        return False
    values = range(start, end, step)
    return len(values) == 0 or (0 <= values[0] and values[-1] < size)


# Ops whose output holds positions along ``dim`` of their input, each in [0, that dim's size):
# which output (``None``: the op's only one) and where ``dim`` is given (its argument position,
# default -1; ``argmax`` without a dim counts positions in the flattened input).
_POSITIONS: dict[str, tuple[int | None, int]] = {
    "topk": (1, 2),
    "sort": (1, 1),
    "argmax": (None, 1),
    "argmin": (None, 1),
}


def _in_range_by_construction(index: torch.fx.Node, size: int) -> bool:
    """Whether every value of ``index`` is by construction a position along a dim no longer
    than ``size``: the indices of ``topk`` or ``sort``, an ``argmax`` or ``argmin``, read through
    ops that only move values (a router's expert ids gathering the experts' weights). Such an
    index needs no check at run time."""
    node = index
    while packet_name(node.target) in SAME_VALUES and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    output: int | None = None
    producer, position = (node.args[0], node.args[1]) if node.target is operator.getitem else (None, None)
    if isinstance(producer, torch.fx.Node) and isinstance(position, int):
        node, output = producer, position
    packet = packet_name(node.target)
    if packet not in _POSITIONS or output != _POSITIONS[packet][0] or not node.args:
        return False
    source = node_value(node.args[0])
    if not isinstance(source, torch.Tensor):
        return False
    slot = _POSITIONS[packet][1]
    dim = (
        node.args[slot] if len(node.args) > slot else node.kwargs.get("dim", -1 if packet in ("topk", "sort") else None)
    )
    if dim is None:
        length = source.numel()
    elif isinstance(dim, int) and -source.dim() <= dim < source.dim():
        length = source.shape[dim]
    else:
        return False
    return isinstance(length, int) and length <= size


def _cone(
    index: torch.fx.Node, before: set[torch.fx.Node], written: set[torch.fx.Node]
) -> tuple[list[torch.fx.Node], str | None]:
    """The nodes after the first write that compute ``index``, or why they cannot move."""
    cone: set[torch.fx.Node] = set()
    frontier = [index]
    while frontier:
        node = frontier.pop()
        if node in cone or node in before:
            continue
        if node.op == "placeholder":
            if node in written:
                return [], f"its index reads {node.name}, which is written in place"
            continue
        if node.op == "get_attr":
            continue
        if node.op != "call_function" or _writes(node) or node.is_impure():
            return [], f"its index depends on {_describe(node)}, which runs after the first write"
        if node.target is operator.getitem and node.args and _is_delegate_call(node.args[0]):  # type: ignore[arg-type]  # a Node: a getitem's input
            return [], f"its index depends on {node.name}, a delegate's output"
        cone.add(node)
        frontier.extend(node.all_input_nodes)
    return [n for n in index.graph.nodes if n in cone], None


def written_placeholders(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Placeholders some node may write: the first argument of a mutating op, through the
    chain of in-place results, and every placeholder a delegate call receives."""
    written: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if not _writes(node):
            continue
        if _is_delegate_call(node):
            written.update(n for n in node.all_input_nodes if n.op == "placeholder")
            continue
        dest = node.args[0] if node.args else None
        seen = 0
        while isinstance(dest, torch.fx.Node) and dest.op != "placeholder" and _writes(dest) and seen < 64:
            dest = dest.args[0] if dest.args else None
            seen += 1
        if isinstance(dest, torch.fx.Node) and dest.op == "placeholder":
            written.add(dest)
    return written


def fake_mode_of(graph: torch.fx.Graph) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in graph.nodes if "val" in n.meta])


class Inserter:
    """Inserts edge calls before one node, with their ``val`` computed on fake tensors (also used
    by :mod:`writeback_passes.input_checks`)."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake: Any) -> None:
        self.graph, self.anchor, self.fake = graph, anchor, fake
        self.created: list[torch.fx.Node] = []

    def call(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> torch.fx.Node:
        """``target`` is an edge op's name (``"index.Tensor"``) or an op (``aten.sym_size.int``)."""
        kwargs = kwargs or {}
        op = edge_op(target) if isinstance(target, str) else target
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(op, args, kwargs)
        self.created.append(node)

        def fake(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                return a.meta.get("val")
            if isinstance(a, (list, tuple)):
                return type(a)(fake(x) for x in a)
            return a

        with self.fake:
            node.meta["val"] = getattr(op, "_op", op)(*fake(args), **fake(kwargs))
        return node


def check_indices_first(program: ExportedProgram | torch.fx.GraphModule) -> IndexCheckReport:
    """Check each run-time index read after the first state write before that write (see the module
    docstring); the node reads the checked index instead."""
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    graph = gm.graph
    report = IndexCheckReport(gm)
    nodes = list(graph.nodes)
    first = next((n for n in nodes if _writes(n)), None)
    if first is None:
        return report
    report.first_write = first.name
    before = set(nodes[: nodes.index(first)])
    uses = [u for n in nodes[nodes.index(first) + 1 :] if n.op == "call_function" for u in _index_uses(n)]
    if not uses:
        return report
    written = written_placeholders(graph)
    fake = fake_mode_of(graph)
    aranges: dict[int, torch.fx.Node] = {}
    checks: dict[tuple[torch.fx.Node, int, str], torch.fx.Node] = {}
    for use in uses:
        key = (use.index, use.size, use.negatives)
        check = checks.get(key)
        if check is None:
            cone, why = _cone(use.index, before, written)
            if why is not None:
                report.unchecked.append(UncheckedIndex(_describe(use.node), use.index.name, why))
                continue
            # Right after what the index reads (not just before the first write): a write-back
            # placed right after its value stays there.
            anchor = _after_inputs(graph, cone or [use.index], set(cone), set(aranges.values()))
            for node in cone:
                anchor.prepend(node)
                before.add(node)
                report.moved.append(node.name)
            head = next(n for n in graph.nodes if n.op != "placeholder")
            if use.size not in aranges:
                aranges[use.size] = Inserter(graph, head, fake).call(
                    "arange.start_step", (0, use.size, 1), {"dtype": torch.int64}
                )
                before.add(aranges[use.size])
            elif aranges[use.size] is not head:
                head.prepend(aranges[use.size])  # an arange reads nothing: first, before every check
            inserter = Inserter(graph, anchor, fake)
            index = use.index
            if use.negatives == "reject":
                negative = inserter.call("lt.Scalar", (index, 0))
                below = inserter.call("add.Scalar", (index, -use.size))
                index = inserter.call("where.self", (negative, below, index))
            check = inserter.call("index.Tensor", (aranges[use.size], [index]))
            before.update(inserter.created)
            checks[key] = check
        _replace(use, check)
        report.checked.append(use.node.name)
    if report.unchecked:
        listed = "; ".join(f"{u.node} ({u.reason})" for u in report.unchecked)
        warnings.warn(
            f"writeback could not check these run-time indices before the first state write "
            f"({report.first_write}): {listed}. If the runtime refuses one (out of range), the state "
            "writes before it stay done; compute the index from the inputs (or from state read before "
            "any write) to have it checked first",
            UncheckedIndexWarning,
            stacklevel=2,
        )
    if report.modified:
        graph.eliminate_dead_code()  # the wraps and guards the checks replaced
        graph.lint()
        gm.recompile()
    return report


def _after_inputs(
    graph: torch.fx.Graph, nodes: list[torch.fx.Node], inside: set[torch.fx.Node], heads: set[torch.fx.Node]
) -> torch.fx.Node:
    """The node just after the last input of ``nodes`` from outside ``inside`` (the first
    non-placeholder when they read only placeholders and constants), past ``heads``."""
    inputs = {i for n in nodes for i in (n.all_input_nodes if n in inside else [n])} - inside
    last: torch.fx.Node | None = None
    for node in graph.nodes:
        if node in inputs:
            last = node
    current = last.next if last is not None else next(iter(graph.nodes))
    while current.op == "placeholder" or current in heads:
        current = current.next
    return current


def _describe(node: torch.fx.Node) -> str:
    """``the write into state 'b_b'`` for an in-place write into a placeholder, else the op's name."""
    dest: object = node
    seen = 0
    while isinstance(dest, torch.fx.Node) and dest.op != "placeholder" and _writes(dest) and seen < 64:
        dest = dest.args[0] if dest.args else None
        seen += 1
    op = packet_name(node.target) or node.name
    if isinstance(dest, torch.fx.Node) and dest.op == "placeholder":
        return f"{op} into state {dest.name!r}"
    return f"{op} ({node.name})"


def _replace(use: _Use, check: torch.fx.Node) -> None:
    position, item = use.slot
    args = list(use.node.args)
    if item is None:
        args[position] = check
    else:
        entries = list(args[position])  # type: ignore[arg-type]  # the indices list, per _index_uses
        entries[item] = check
        args[position] = entries
    use.node.args = tuple(args)


def index_checks_pass() -> ProgramPass:
    """This pass as a ``"before_memory_planning"`` :class:`~writeback_core.ProgramPass`, after
    early write-back: the writes are then where they will run."""
    from writeback_passes.backend_names import STOCK_RUNTIME

    return ProgramPass(
        name="check_indices_first",
        stage="before_memory_planning",
        run=check_indices_first,
        after=("insert_write_back_early",),
        backends=STOCK_RUNTIME,
        reason="indices checked before the first state write",
    )
