"""The one rule for which clone of an engine input the engine's lowering removes.

Both sides use it: the engine's lowering (``peel_input_clones``, run on the
partition it is handed) and the classifier, which must predict what the
lowering will see. A prediction that reads the graph as it is at
classification time, rather than as the lowering will leave it, files a cloned
cache write as copy-back while the engine aliases it anyway.
"""

from __future__ import annotations

import torch
import torch.fx
from writeback_core.ops import aten_op

__all__ = ["peel_input_clones", "peeled_input"]

# ``aten.clone`` and exir's dim-order form of it (``to_edge`` turns one into the other).
_CLONES = {("aten", "clone"), ("dim_order_ops", "_clone_dim_order")}


def _is_clone(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    op = aten_op(node.target)
    if not isinstance(op, torch._ops.OpOverload):
        return False
    return (op.namespace, op._opname) in _CLONES


def peeled_input(node: object) -> torch.fx.Node | None:
    """The placeholder ``node`` is once the lowering has peeled input clones, else ``None``.

    A placeholder is itself. A clone is peeled only when its input is a
    placeholder **and** that placeholder's sole user is the clone: a placeholder
    another node also reads keeps its clone, because erasing it would let a
    write through the clone change what the other reader sees. Anything else
    is not an engine input.
    """
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "placeholder":
        return node
    if not _is_clone(node) or not node.args:
        return None
    source = node.args[0]
    if isinstance(source, torch.fx.Node) and source.op == "placeholder" and len(source.users) == 1:
        return source
    return None


def peel_input_clones(graph: torch.fx.Graph) -> list[str]:
    """Erase every clone that :func:`peeled_input` says the lowering peels; return their names.

    Algorithm:
      1. For each clone node, in graph order, ask :func:`peeled_input`.
      2. If it names a placeholder, point the clone's users at the placeholder
         and erase the clone.

    Refuses (keeps) ``clone(x)`` when ``x`` has another reader, e.g.
    ``k = cache.clone(); k[:, :, 3:4] = v; return k.sum() + cache.sum()``.
    """
    peeled: list[str] = []
    for node in list(graph.nodes):
        if not _is_clone(node):
            continue
        source = peeled_input(node)
        if source is None:
            continue
        node.replace_all_uses_with(source)
        peeled.append(node.name)
        graph.erase_node(node)
    return peeled
