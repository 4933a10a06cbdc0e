"""Two of exir's ATen-to-edge passes skipped while they find nothing (:func:`edge_passes_pruned`).

Building the edge program, exir runs a list of passes over the whole program, most of them an
``ExportPass``: each traces every node again, with fake tensors, to rewrite the few it is for.
On a 0.5B decoder each such trace takes seconds. Two of them have nothing to rewrite in a
program that went through the default decompositions:

- ``NormalizeTransposePass`` rewrites ``aten.t`` (which the decompositions turn into
  ``aten.permute``);
- ``ReplaceBrokenOpsWithFunctionalOpsPass`` rewrites view operators (which exir's
  ``ReplaceViewOpsWithViewCopyOpsPass``, run before it, has made copies).

While :func:`edge_passes_pruned` is entered:

1. before either pass runs, look in the graph (and in every control-flow subgraph) for a node
   it rewrites (:data:`_REWRITES`);
2. none: the pass returns the graph as it was given, unchanged; else it runs as exir runs it.

The pass that exir runs after them, ``ScalarToTensorPass``, traces the graph it is given and
builds every node anew: a trace before it changes nothing it makes. So the edge program and
the ``.pte`` are the same byte for byte (tests/core/test_edge_passes.py compares them).
Refused: skipping a pass whose rewrites depend on more than the op (``ScalarToTensorPass``,
``RemoveMixedTypeOperators``, ``SymToTensorPass``): what it would change is not read off here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["edge_passes_pruned"]


def _transpose(node: torch.fx.Node) -> bool:
    return node.target is torch.ops.aten.t.default


def _view(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and bool(node.target.is_view)


# exir's pass (class name) -> whether it rewrites a node.
_REWRITES: dict[str, Callable[[torch.fx.Node], bool]] = {
    "NormalizeTransposePass": _transpose,
    "ReplaceBrokenOpsWithFunctionalOpsPass": _view,
}


def _rewrites_some_node(graph_module: torch.fx.GraphModule, rewrites: Callable[[torch.fx.Node], bool]) -> bool:
    """Whether ``rewrites`` holds for a call of ``graph_module`` or of a subgraph it holds."""
    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            if any(node.op == "call_function" and rewrites(node) for node in module.graph.nodes):
                return True
    return False


@contextmanager
def edge_passes_pruned() -> Iterator[None]:
    """While the block runs, exir's ``NormalizeTransposePass`` and
    ``ReplaceBrokenOpsWithFunctionalOpsPass`` return a graph they find nothing to rewrite in
    as it was given (see the module docstring). Process-wide while the block runs. A pass
    exir no longer has is left alone."""
    from executorch.exir import passes
    from executorch.exir.pass_base import PassResult

    patched: list[tuple[type, Any]] = []
    for name, rewrites in _REWRITES.items():
        cls = getattr(passes, name, None)
        if cls is None:
            continue

        original = cls.__dict__.get("call")

        def call(
            self: Any,
            graph_module: torch.fx.GraphModule,
            *,
            _rewrites: Any = rewrites,
            _cls: Any = cls,
            _original: Any = original,
        ) -> Any:
            if not _rewrites_some_node(graph_module, _rewrites):
                return PassResult(graph_module, False)
            if _original is not None:
                return _original(self, graph_module)
            return super(_cls, self).call(graph_module)

        patched.append((cls, original))
        setattr(cls, "call", call)  # noqa: B010
    try:
        yield
    finally:
        for cls, original in patched:
            if original is None:
                delattr(cls, "call")
            else:
                setattr(cls, "call", original)  # noqa: B010
