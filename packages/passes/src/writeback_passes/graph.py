"""Readers of an edge graph's nodes and the op families the passes share, each in one place.

Op families are sets of packet names (:func:`writeback_core.ops.packet_name`: ``view_copy``
for ``aten.view_copy.default`` or its edge wrapper).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["CLONES", "MATMULS", "UNIT_DIM_RESHAPES", "VIEWS_AND_EXPANDS", "arg_value", "tensor_value"]

# Copies exir's later passes turn into views (view_copy) or that only broadcast (expand_copy).
VIEWS_AND_EXPANDS = frozenset({"view_copy", "expand_copy"})
# Copies that add or drop a dimension of size one.
UNIT_DIM_RESHAPES = frozenset({"unsqueeze_copy", "squeeze_copy"})
# Whole-tensor copies, the dim-order variant exir writes included.
CLONES = frozenset({"clone", "_clone_dim_order"})
MATMULS = frozenset({"bmm", "mm"})


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
