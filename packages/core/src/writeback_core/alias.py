"""One alias analysis for every pass: which graph values may share storage, and who writes it.

Built once per graph in a single forward walk. Each tensor value belongs to a
storage class (a union-find set); two values may alias when their classes are
the same. The walk merges classes from what is known for sure and is
conservative where it is not:

1. ``aten::`` schemas are trusted: a return whose alias set matches an
   argument's (``view(Tensor(a) self) -> Tensor(a)``, ``add_(Tensor(a!) ...)``,
   out= variants) joins that argument's class; an argument marked ``!`` is
   written. A return with no alias annotation is fresh storage. Ops of exir's
   own ``dim_order_ops`` namespace are trusted the same way (their schemas are
   exir's, not a user's).
2. Everything else is assumed to alias and write every tensor it receives:
   non-``aten`` schemas (a custom op with a schema but no ``(a!)`` annotation
   still counts as writing), ``getitem``, submodule and delegate calls, and
   targets with no schema at all.
3. exir's reinplace pass records an output that shares its input's allocation
   in ``node.meta["_share_alloc_with_arg_idx"]``; no schema shows it, so it is
   added as an alias edge and a write of that argument.

The union-find makes the analysis near-linear in graph size; its only
imprecision is that aliasing is transitive (``a~b`` and ``b~c`` gives ``a~c``),
which errs on the safe side.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.fx

from writeback_core import meta
from writeback_core.ops import aten_op, schema_of

__all__ = ["AliasAnalysis"]

_TRUSTED_NAMESPACES = ("aten::", "dim_order_ops::")

# Python callables exir places in graphs that return fresh storage and read nothing.
_FRESH_CALLABLES = {"alloc"}


def _is_tensorish(node: torch.fx.Node) -> bool:
    """Whether a node may carry tensor storage (unknown ``val`` counts as yes)."""
    if "val" not in node.meta:
        return node.op != "output"
    return _holds_tensor(node.meta["val"])


def _holds_tensor(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (list, tuple)):
        return any(_holds_tensor(v) for v in val)
    return False


def _nodes_in(value: Any) -> Iterator[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _nodes_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _nodes_in(item)


class AliasAnalysis:
    """May-alias and may-write facts for the nodes of one ``torch.fx.Graph``.

    Build it after the last edit of the graph you query: a node added later is
    unknown to it and queries on it raise ``KeyError``.
    """

    def __init__(self, graph: torch.fx.Graph) -> None:
        self._parent: dict[torch.fx.Node, torch.fx.Node] = {}
        self._writes: dict[torch.fx.Node, tuple[torch.fx.Node, ...]] = {}
        self._order: dict[torch.fx.Node, int] = {}
        self._members: dict[torch.fx.Node, frozenset[torch.fx.Node]] | None = None
        self._writers: dict[torch.fx.Node, tuple[torch.fx.Node, ...]] | None = None
        for position, node in enumerate(graph.nodes):
            self._order[node] = position
            self._visit(node)

    # -- building -------------------------------------------------------------

    def _find(self, node: torch.fx.Node) -> torch.fx.Node:
        parent = self._parent
        root = node
        while parent[root] is not root:
            root = parent[root]
        while parent[node] is not root:
            parent[node], node = root, parent[node]
        return root

    def _union(self, a: torch.fx.Node, b: torch.fx.Node) -> None:
        if a not in self._parent or b not in self._parent:
            return
        ra, rb = self._find(a), self._find(b)
        if ra is rb:
            return
        # Keep the earlier node as root so roots are stable and deterministic.
        if self._order[rb] < self._order[ra]:
            ra, rb = rb, ra
        self._parent[rb] = ra

    def _visit(self, node: torch.fx.Node) -> None:
        if node.op == "output":
            return
        if not _is_tensorish(node):
            return
        self._parent[node] = node
        if node.op in ("placeholder", "get_attr"):
            return
        if node.op == "call_function":
            self._visit_call(node)
        else:
            self._conservative(node)
        share = node.meta.get(meta.EXIR_SHARE_ALLOC)
        if isinstance(share, int) and 0 <= share < len(node.args):
            for arg in _nodes_in(node.args[share]):
                self._union(node, arg)
                self._add_write(node, [arg])

    def _visit_call(self, node: torch.fx.Node) -> None:
        target = node.target
        if getattr(target, "__name__", None) in _FRESH_CALLABLES and not isinstance(
            aten_op(target), torch._ops.OpOverload
        ):
            return
        if target is operator.getitem:
            self._conservative(node, write=False)
            return
        schema = schema_of(target)
        if schema is None or not schema.name.startswith(_TRUSTED_NAMESPACES):
            self._conservative(node)
            return
        self._from_schema(node, schema)

    def _conservative(self, node: torch.fx.Node, write: bool = True) -> None:
        tensors = [a for a in _nodes_in((node.args, node.kwargs)) if a in self._parent]
        for arg in tensors:
            self._union(node, arg)
        if write and tensors:
            self._add_write(node, tensors)

    def _from_schema(self, node: torch.fx.Node, schema: torch.FunctionSchema) -> None:
        bound: list[tuple[Any, Any]] = []
        for position, argument in enumerate(schema.arguments):
            if position < len(node.args) and not argument.kwarg_only:
                bound.append((argument, node.args[position]))
            elif argument.name in node.kwargs:
                bound.append((argument, node.kwargs[argument.name]))
        written: list[torch.fx.Node] = []
        for argument, value in bound:
            info = argument.alias_info
            if info is not None and info.is_write:
                written.extend(n for n in _nodes_in(value) if n in self._parent)
        if written:
            self._add_write(node, written)
        for ret in schema.returns:
            info = ret.alias_info
            if info is None:
                continue
            sets = set(info.before_set) | set(info.after_set)
            for argument, value in bound:
                arg_info = argument.alias_info
                if arg_info is None:
                    continue
                arg_sets = set(arg_info.before_set) | set(arg_info.after_set)
                if "*" in sets or "*" in arg_sets or sets & arg_sets:
                    for n in _nodes_in(value):
                        self._union(node, n)

    def _add_write(self, node: torch.fx.Node, targets: Iterable[torch.fx.Node]) -> None:
        self._writes[node] = (*self._writes.get(node, ()), *targets)
        self._writers = None

    # -- queries --------------------------------------------------------------

    def _known(self, node: torch.fx.Node) -> bool:
        if node not in self._order:
            raise KeyError(f"node {node.name!r} was added after the alias analysis was built")
        return node in self._parent

    def may_alias(self, a: torch.fx.Node, b: torch.fx.Node) -> bool:
        """Whether ``a`` and ``b`` may share storage (a node always aliases itself)."""
        if not (self._known(a) and self._known(b)):
            return False
        return self._find(a) is self._find(b)

    def aliases(self, node: torch.fx.Node) -> frozenset[torch.fx.Node]:
        """Every node that may share storage with ``node``, itself included."""
        if not self._known(node):
            return frozenset()
        if self._members is None:
            groups: dict[torch.fx.Node, set[torch.fx.Node]] = {}
            for member in self._parent:
                groups.setdefault(self._find(member), set()).add(member)
            self._members = {root: frozenset(g) for root, g in groups.items()}
        return self._members[self._find(node)]

    def writes(self, node: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
        """The argument nodes ``node`` may write into (empty for a pure function)."""
        return self._writes.get(node, ())

    def writes_alias_of(self, writer: torch.fx.Node, node: torch.fx.Node) -> bool:
        """Whether ``writer`` may write storage that ``node`` may point to."""
        if not self._known(node):
            return False
        root = self._find(node)
        return any(self._find(w) is root for w in self._writes.get(writer, ()))

    def writers_of(self, node: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
        """Every node that may write storage ``node`` may point to, in graph order."""
        if not self._known(node):
            return ()
        if self._writers is None:
            index: dict[torch.fx.Node, list[torch.fx.Node]] = {}
            for writer, targets in self._writes.items():
                for root in {self._find(t) for t in targets}:
                    index.setdefault(root, []).append(writer)
            self._writers = {root: tuple(sorted(ws, key=self._order.__getitem__)) for root, ws in index.items()}
        return self._writers.get(self._find(node), ())

    def position(self, node: torch.fx.Node) -> int:
        """The node's index in the graph at build time (for ordering queries)."""
        return self._order[node]
