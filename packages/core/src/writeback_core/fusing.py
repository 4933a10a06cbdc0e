"""exir's partition fusing with the program's code generated once (:func:`code_generated_once`).

``to_edge_transform_and_lower`` fuses each partition a partitioner tagged into a submodule of
the edge program, one partition after another (exir's ``create_submodule_from_nodes``). After
each fusion it sorts the whole program's graph again (torch's ``legalize_graph``: every node
copied into a new graph), and setting the new graph on the program's ``GraphModule``
regenerates and compiles the Python code of the whole program. Nothing reads that code until
every partition is fused, so on a 0.5B decoder (123 partitions of a graph of about 2,000 nodes)
it was generated 123 times for the one version anything runs: about a tenth of
``writeback export``'s time.

While :func:`code_generated_once` is entered:

1. each ``legalize_graph`` exir runs while fusing sorts the graph as torch does (the same nodes
   in the same order, so every later step sees the graph it saw before), but the program's
   code is marked out of date instead of generated;
2. when exir's fusing of one program's partitions returns, the code of every program marked
   is generated once, from its final graph, as the last of the skipped generations would
   have made it.

The code is a function of the graph alone, so the ``.pte`` is the same byte for byte
(tests/core/test_fusing.py compares a lowering with and without). Refused: leaving a program's
code out of date past the fusing step: exir runs the program's passes right after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["code_generated_once"]


@contextmanager
def code_generated_once() -> Iterator[None]:
    """While the block runs, exir's fusing of partitions generates each program's code once
    (see the module docstring). Process-wide while the block runs, as
    :func:`~writeback_core.lowering.preprocess_shares_constants` is. An exir without the two
    functions fuses as it does."""
    from executorch.exir import lowered_backend_module
    from executorch.exir.backend import backend_api

    sort: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = getattr(
        lowered_backend_module, "legalize_graph", None
    )
    fuse: Callable[..., Any] | None = getattr(backend_api, "_create_partitions_in_graph_module", None)
    if sort is None or fuse is None:
        yield
        return
    stale: dict[int, torch.fx.GraphModule] = {}

    def sort_later(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
        # The GraphModule.graph setter legalize_graph uses regenerates the code through the
        # instance's recompile: for this call, it marks the module instead.
        setattr(graph_module, "recompile", lambda: stale.setdefault(id(graph_module), graph_module))  # noqa: B010
        try:
            return sort(graph_module)
        finally:
            delattr(graph_module, "recompile")

    def regenerate() -> None:
        while stale:
            _, graph_module = stale.popitem()
            graph_module.recompile()

    def fuse_then_regenerate(*args: Any, **kwargs: Any) -> Any:
        try:
            return fuse(*args, **kwargs)
        finally:
            regenerate()

    setattr(lowered_backend_module, "legalize_graph", sort_later)  # noqa: B010
    setattr(backend_api, "_create_partitions_in_graph_module", fuse_then_regenerate)  # noqa: B010
    try:
        yield
    finally:
        setattr(lowered_backend_module, "legalize_graph", sort)  # noqa: B010
        setattr(backend_api, "_create_partitions_in_graph_module", fuse)  # noqa: B010
        regenerate()
