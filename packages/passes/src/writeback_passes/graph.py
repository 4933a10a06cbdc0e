"""Readers of an edge graph's nodes and the op families the passes share, each in one place.

Op families are sets of packet names (:func:`writeback_core.ops.packet_name`: ``view_copy``
for ``aten.view_copy.default`` or its edge wrapper); those a backend shares with the passes
(``MATMULS``, ``VIEWS_AND_EXPANDS``) are :mod:`writeback_core.ops`'.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from executorch.exir.delegate import executorch_call_delegate
from writeback_core import AliasAnalysis
from writeback_core.ops import packet_name, schema_of

__all__ = [
    "CLONES",
    "METADATA_ONLY",
    "UNIT_DIM_RESHAPES",
    "StorageAliases",
    "arg_value",
    "reads_no_value",
    "tensor_value",
    "views_of",
]

# Copies that add or drop a dimension of size one.
UNIT_DIM_RESHAPES = frozenset({"unsqueeze_copy", "squeeze_copy"})
# Whole-tensor copies, the dim-order variant exir writes included.
CLONES = frozenset({"clone", "_clone_dim_order"})
# Ops that look at a tensor's shape, dtype or strides and never at its elements.
METADATA_ONLY = frozenset(
    {
        "_assert_tensor_metadata",
        "sym_size",
        "sym_numel",
        "sym_stride",
        "sym_storage_offset",
        "_assert_scalar",
        "sym_constrain_range_for_size",
    }
)

# Ops that exir turns into real views after the passes of ``ExecutorchBackendConfig``
# run (``ReplaceViewCopyWithViewPass``, keyed on ``view_copy.default``). At the time
# this pass runs they still copy, but once memory is planned their result shares
# the input's storage, so a read through them is a read of their input.
_BECOMES_VIEW = frozenset({"view_copy"})


class StorageAliases:
    """Alias classes of ``graph`` widened by the view edges exir adds after the program passes
    run (``view_copy`` becomes a real view): which nodes may share storage once memory is
    planned, and which nodes may write it. The passes that move or reinplace a write-back
    ask it whether a read or a write touches the state's memory."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.alias = AliasAnalysis(graph)
        self._cache: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}

    def members(self, node: torch.fx.Node) -> frozenset[torch.fx.Node]:
        """Every node that may share storage with ``node`` once exir's views exist."""
        cached = self._cache.get(node)
        if cached is not None:
            return cached
        seen: set[torch.fx.Node] = set()
        frontier = [node]
        while frontier:
            current = frontier.pop()
            if current in seen:
                continue
            group = self.alias.aliases(current) or frozenset({current})
            seen.update(group)
            for member in group:
                if packet_name(member.target) in _BECOMES_VIEW and member.args:
                    base = member.args[0]
                    if isinstance(base, torch.fx.Node):
                        frontier.append(base)
                frontier.extend(
                    u for u in member.users if packet_name(u.target) in _BECOMES_VIEW and u.args and u.args[0] is member
                )
        result = frozenset(seen)
        for member in result:
            self._cache[member] = result
        return result

    def writers(self, node: torch.fx.Node) -> Iterable[torch.fx.Node]:
        """Every node that may write storage ``node`` may point to (views included)."""
        roots: dict[int, torch.fx.Node] = {}
        for member in self.members(node):
            group = self.alias.aliases(member)
            roots.setdefault(id(group), member)
        for member in roots.values():
            yield from self.alias.writers_of(member)


def reads_no_value(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads only metadata of its arguments (so never an old value)."""
    return node.op == "call_function" and packet_name(node.target) in METADATA_ONLY


def tensor_value(node: object) -> torch.Tensor | None:
    """The traced tensor of ``node`` (its ``meta["val"]``); ``None`` for a literal, a node
    without one, or a value that is not a tensor."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def arg_value(node: torch.fx.Node, index: int, name: str, default: Any) -> Any:
    """Argument ``index`` of ``node``'s call, given by position or by ``name``, else ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _returns_alias(node: torch.fx.Node, arg: torch.fx.Node) -> bool:
    """Whether ``node``'s result may share storage with its argument ``arg``."""
    if node.target is operator.getitem:
        return False
    if node.target is executorch_call_delegate:
        # A delegate writes its results into outputs the runtime allocated.
        return False
    schema = schema_of(node.target)
    if schema is None or not schema.name.startswith("aten::"):
        return True  # unknown callable (memory.view, a custom op): assume it aliases
    returns = {s for r in schema.returns if r.alias_info for s in r.alias_info.after_set}
    for position, argument in enumerate(schema.arguments):
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        if value is arg and argument.alias_info is not None:
            if returns & set(argument.alias_info.before_set) or argument.alias_info.is_write:
                return True
    return False


def views_of(placeholder: torch.fx.Node) -> set[torch.fx.Node]:
    """``placeholder`` and every node that may view its storage, found through the schemas of
    its users (a delegate call and its results never view their arguments: the delegate writes
    its results into memory the runtime allocates)."""
    found = {placeholder}
    frontier = [placeholder]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in found and user.op == "call_function" and _returns_alias(user, node):
                found.add(user)
                frontier.append(user)
    return found
