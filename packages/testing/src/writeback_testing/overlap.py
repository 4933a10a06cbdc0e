"""Eager runs that refuse an in-place write whose source overlaps its destination.

``s.select(2, 1).copy_(s.reshape(-1)[0:4].reshape(2, 2))`` reads elements
of ``s`` that the same ``copy_`` writes: eager PyTorch copies element by
element, so what it computes depends on the kernel's iteration order, while
``torch.export`` (functional: every source read before the write) computes
another value. Eager raises on some such overlaps ("refer to a single memory
location") and silently answers on strided ones. Neither answer is a ground
truth to compare a lowered program with, so the oracle treats the program as
invalid (:class:`OverlappingWrite`), the same as the overlaps eager refuses.

The check compares the storage offsets the two tensors cover (programs hold at
most a few dozen elements): disjoint is fine, and so is the same element for
the same element (``s.add_(s)``, elementwise); anything else is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["NoOverlappingWrites", "OverlappingWrite", "overlaps"]


class OverlappingWrite(RuntimeError):
    """An in-place op read elements it also wrote: its eager result depends on iteration order."""


def _offsets(tensor: torch.Tensor) -> torch.Tensor:
    """The storage offset (in elements) of every element of ``tensor``, in its shape."""
    extent = (
        tensor.storage_offset()
        + 1
        + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    )
    flat = torch.arange(int(extent))
    return flat.as_strided(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def overlaps(dest: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether writing ``dest`` in place while reading ``src`` depends on the order of elements.

    ``False`` when they share no storage, cover disjoint elements, or read
    exactly the element each writes (same shape, same offsets).
    """
    if dest.numel() == 0 or src.numel() == 0:
        return False
    if dest.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
        return False
    if dest.dtype.itemsize != src.dtype.itemsize:
        return True  # shared bytes read as another type: refuse rather than reason about it
    written, read = _offsets(dest), _offsets(src)
    if written.shape == read.shape and torch.equal(written, read):
        return False
    return bool(torch.isin(read.reshape(-1), written.reshape(-1)).any())


def _writes_first_argument(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


class NoOverlappingWrites(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode base is untyped
    """While active, an op that writes its first argument in place raises
    :class:`OverlappingWrite` when another tensor argument overlaps it (:func:`overlaps`)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's mode base is untyped

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and _writes_first_argument(func):
            dest = args[0]
            for other in tree_leaves((args[1:], kwargs)):
                if isinstance(other, torch.Tensor) and overlaps(dest, other):
                    raise OverlappingWrite(
                        f"{func} writes elements it also reads (destination {tuple(dest.shape)}, "
                        f"source {tuple(other.shape)} in the same storage): eager's answer depends "
                        "on the order the kernel visits elements; read the source with .clone()"
                    )
        return func(*args, **kwargs)
