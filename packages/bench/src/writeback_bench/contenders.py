"""What the benches share: the contenders' names that both benches of ``writeback bench``
use (:mod:`writeback_bench.cache_sizes`, :mod:`writeback_bench.model_steps`), their warm-up
count, the timed call, the text of their cells, and :func:`stock_program`, the stock
ExecuTorch lowering every bench compares writeback with (``bench-generate`` and
``bench_attention`` included), with :func:`write_stock_pte` saving it as users do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "EAGER",
    "STOCK",
    "WARMUP",
    "XNNPACK",
    "Call",
    "format_ms",
    "format_ratio",
    "short_error",
    "stock_program",
    "write_stock_pte",
]

STOCK = "stock"
XNNPACK = "stock+xnnpack"
EAGER = "eager"
WARMUP = 2

# One timed call at a step: ``(seconds, outputs)``. Each call times only the work
# itself (the runtime's execute, the eager forward, the two copies); its inputs
# are made before the clock starts.
Call = Callable[[int], tuple[float, list[Any]]]


def stock_program(
    exported: Any, xnnpack: bool, config: Any = None, constant_methods: dict[str, Any] | None = None
) -> Any:
    """``exported`` (an ``ExportedProgram``) lowered as ExecuTorch users lower it:
    ``to_edge_transform_and_lower`` with ExecuTorch's ``XnnpackPartitioner`` when ``xnnpack``
    (no partitioner else) and ``constant_methods`` (runner metadata), then
    ``to_executorch(config)`` (``None``: exir's default ``ExecutorchBackendConfig``).

    Returns exir's ``ExecutorchProgramManager``: its ``buffer`` is the ``.pte``, its
    ``exported_program()`` the final graph. Warnings are the caller's to filter.
    """
    from executorch.exir import to_edge_transform_and_lower

    partitioners: list[Any] = []
    if xnnpack:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioners.append(XnnpackPartitioner())
    edge = to_edge_transform_and_lower(exported, partitioner=partitioners, constant_methods=constant_methods)
    return edge.to_executorch(config)


def write_stock_pte(
    exported: Any, path: Any, xnnpack: bool, config: Any = None, constant_methods: dict[str, Any] | None = None
) -> Any:
    """:func:`stock_program` of ``exported`` streamed to the file ``path`` as ExecuTorch's
    export scripts save a program (exir's ``write_to_file``: the serialized pieces one after
    the other, never one joined copy of the weights in memory). Returns the program manager."""
    program = stock_program(exported, xnnpack, config, constant_methods)
    with open(path, "wb") as handle:
        program.write_to_file(handle)
    return program


def short_error(error: BaseException) -> str:
    """``error``'s type and first line, cut to fit a table cell."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) < 160 else text[:157] + "..."


def format_ms(seconds: float | None) -> str:
    """A duration in ms (µs below 1 ms); ``-`` for none."""
    if seconds is None:
        return "-"
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"


def format_ratio(num: float | None, den: float | None) -> str:
    """``num / den`` as ``2.5x``; ``-`` when either is missing or ``den`` is not positive."""
    if num is None or den is None or den <= 0:
        return "-"
    return f"{num / den:.1f}x"
