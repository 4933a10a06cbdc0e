"""What one entry of the MLX delegate's op table is (:class:`OpHandler`), what a write
into part of a destination is (:class:`Region`), and the dtypes the delegate computes in.

The table itself is ``writeback_mlx_backend.op_table``; the handlers are in ``op_math``,
``op_shapes`` and ``op_indexing``, their support checks in ``op_checks``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import torch
import torch.fx

from writeback_mlx_backend.delegate_program import torch_dtype

__all__ = ["MAX_MLX_INT", "MX_DTYPES", "UNKNOWN", "OpHandler", "Region", "mlx_dtype"]

# torch dtypes the delegate computes in, with their MLX and numpy counterparts.
MX_DTYPES: dict[torch.dtype, Any] = {
    torch.float32: mx.float32,
    torch.float16: mx.float16,
    torch.int64: mx.int64,
    torch.int32: mx.int32,
    torch.int16: mx.int16,
    torch.int8: mx.int8,
    torch.uint8: mx.uint8,
    torch.bool: mx.bool_,
}


def mlx_dtype(name: str) -> Any:
    """The MLX dtype of a blob's dtype name (``"float32"``); a name the blob format does not
    know is refused by :func:`~writeback_mlx_backend.delegate_program.torch_dtype`."""
    return MX_DTYPES[torch_dtype(name)]


# MLX holds each dimension, index and element count as a 32-bit int.
MAX_MLX_INT = 2**31 - 1

# An argument whose value is not known yet (passed to ``OpHandler.validate``).
UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "UNKNOWN"})()


@dataclass(frozen=True)
class Region:
    """A write into part of a destination: ``dest[key] = values`` (``+=`` when ``accumulate``)."""

    key: tuple[Any, ...]
    values: np.ndarray
    accumulate: bool = False


@dataclass(frozen=True)
class OpHandler:
    """How the delegate runs one op.

    ``check(node)`` returns the reason the node cannot be delegated, or ``None``;
    ``run(*args, **kwargs)`` computes its MLX value; ``region(*args, **kwargs)``,
    for write ops only, describes the written part of ``args[0]`` (after
    validating indices, so a bad index raises before anything is written);
    ``validate`` checks the indices alone, so a call can check every write first.
    """

    check: Callable[[torch.fx.Node], str | None]
    run: Callable[..., Any]
    region: Callable[..., Region] | None = None
    # For ops that index: ``validate(*args)`` raises on an index ATen rejects; it reads
    # only the indexed tensor's shape and the indices, and skips what is ``UNKNOWN``.
    validate: Callable[..., None] | None = None
    # ``run`` returns its first argument itself (clone and alias ops on immutable
    # MLX arrays): the runtime may name that argument instead of running a step.
    alias: bool = False
    # For ops that index: the positions of ``args`` holding the indices ``validate`` reads.
    index_args: tuple[int, ...] = ()
    # ``run`` without host reads, for a traced (``mx.compile``) step: the indices were
    # validated on the call's inputs before the graph was built. ``None``: ``run`` is
    # already pure MLX.
    trace: Callable[..., Any] | None = None
    # ``bounds(*args, **kwargs)``: each index argument with the range ``[lo, hi)`` its
    # values must lie in, for a quick check on the host; ``validate`` says why not.
    bounds: Callable[..., list[tuple[Any, int, int]]] | None = None
