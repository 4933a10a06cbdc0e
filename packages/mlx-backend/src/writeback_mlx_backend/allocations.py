"""Torch tensors whose memory MLX owns, so the delegate reads them without a copy.

MLX on Linux cannot wrap outside memory (``mx.array(numpy)`` copies), but a
torch view of an MLX array shares its memory both ways. :func:`empty` therefore
allocates in MLX, hands back a torch view, and remembers which MLX array lives
at that base address; the delegate looks incoming tensors up by their data
pointer and uses the MLX array itself. The record is dropped when the returned
tensor object is garbage collected (views made from it still work, but are then
copied like any other tensor).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import torch
import torch.utils.dlpack

from writeback_mlx_backend.op_handler import MX_DTYPES

__all__ = ["empty", "lookup"]


@dataclass(frozen=True)
class _Allocation:
    array: Any
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype


_LOCK = threading.Lock()
# Base data pointer -> the MLX array allocated there. Process-wide by nature:
# it describes memory, which is process-wide too.
_ALLOCATIONS: dict[int, _Allocation] = {}


def _forget(pointer: int) -> None:
    with _LOCK:
        _ALLOCATIONS.pop(pointer, None)


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled torch tensor allocated by MLX, readable by the MLX delegate without a copy.

    Use it for caller-owned state (a KV cache passed as an input): the delegate
    then reads it in place and writes only the updated region into it.
    """
    if dtype not in MX_DTYPES:
        raise ValueError(f"dtype {dtype} is not one of {sorted(map(str, MX_DTYPES))}")
    array = mx.zeros(tuple(int(s) for s in shape), dtype=MX_DTYPES[dtype])
    mx.eval(array)
    tensor = torch.utils.dlpack.from_dlpack(array)
    pointer = tensor.data_ptr()
    with _LOCK:
        _ALLOCATIONS[pointer] = _Allocation(array, tensor.numel() * tensor.element_size(), tensor.shape, dtype)
    weakref.finalize(tensor, _forget, pointer)
    return tensor


def lookup(tensor: torch.Tensor) -> Any | None:
    """The MLX array behind ``tensor`` if it covers a whole :func:`empty` allocation, else None."""
    with _LOCK:
        found = _ALLOCATIONS.get(tensor.data_ptr())
    if found is None or tensor.dtype != found.dtype or not tensor.is_contiguous():
        return None
    if tensor.shape == found.shape:
        return found.array  # the common case: the tensor empty() returned
    if found.nbytes != tensor.numel() * tensor.element_size():
        return None
    return found.array.reshape(tuple(tensor.shape))
