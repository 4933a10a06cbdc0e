"""How much memory this machine can give a new process: the one figure every size bound
(``--cache-mib``, a model folder's size) is checked against; and giving back the pages of a
mapped file a model was read from (:class:`FilePages`)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["GIB", "FilePages", "available_memory", "drop_pages"]

GIB = 1 << 30


def available_memory() -> tuple[int, str] | None:
    """Bytes of memory this machine can give a new process, and how they were found
    (``"available"``: the kernel's MemAvailable; ``"in all"``: physical memory), or
    ``None`` where neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "in all"
    except (OSError, ValueError, AttributeError):
        return None


class FilePages:
    """The pages of a mapped file behind tensors, given back to the system without losing a byte.

    A model read from safetensors is often a map of the file: its weights' pages count in the
    process's resident memory once read, for as long as the map lives, even after the weights
    themselves were replaced (quantized). :meth:`release` drops a tensor's whole pages with
    ``madvise(MADV_DONTNEED)``; a page read again comes back from the file, unchanged.

    That holds only for a map no one has written to: a private map's written page is the
    process's own copy, which dropping would lose. So only maps of a regular file with no
    written page (``Anonymous: 0 kB`` in ``/proc/self/smaps``) when this object is made are
    released from; a tensor anywhere else is left alone. Linux only: elsewhere nothing is
    released.
    """

    def __init__(self) -> None:
        self._maps = _clean_file_maps()

    def release(self, tensor: torch.Tensor) -> int:
        """Drop the whole pages of ``tensor``'s storage where it lies in a clean file map; the
        bytes dropped (0: not in one, or not possible here)."""
        try:
            storage = tensor.untyped_storage()
            pointer, nbytes = int(storage.data_ptr()), int(storage.nbytes())
        except (RuntimeError, NotImplementedError):  # no storage of its own (a fake or subclass tensor)
            return 0
        if not nbytes or not any(lo <= pointer and pointer + nbytes <= hi for lo, hi in self._maps):
            return 0
        return drop_pages(pointer, nbytes)


_MADV_DONTNEED = 4  # Linux: drop the pages; a file's come back from the file if read again


def drop_pages(pointer: int, nbytes: int) -> int:
    """Hand the whole pages of ``[pointer, pointer + nbytes)`` back to the system (``madvise``);
    the bytes dropped (0 where that is not possible). The caller makes sure nothing lost matters:
    the range is a clean file map (:class:`FilePages`) or memory no one reads again."""
    if not sys.platform.startswith("linux"):
        return 0
    page = mmap.PAGESIZE
    first, last = -(-pointer // page) * page, (pointer + nbytes) // page * page
    if last <= first:
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    done = libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
    return last - first if done == 0 else 0


def _clean_file_maps() -> list[tuple[int, int]]:
    """``(start, end)`` of each map of a regular file with no written page, from ``/proc/self/smaps``."""
    if not sys.platform.startswith("linux"):
        return []
    maps: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as smaps:
            for line in smaps:
                head = line.split(maxsplit=5)
                if head and "-" in head[0] and not head[0].endswith(":"):
                    current = None
                    path = head[5].strip() if len(head) == 6 else ""
                    if path.startswith("/") and not path.endswith("(deleted)") and os.path.isfile(path):
                        start, _, end = head[0].partition("-")
                        current = (int(start, 16), int(end, 16))
                elif current is not None and line.startswith("Anonymous:"):
                    if int(line.split()[1]) == 0:
                        maps.append(current)
                    current = None
    except (OSError, ValueError):
        return []
    return maps
