"""Process housekeeping the commands ask for by name: ``writeback run``, ``export`` and
``bench`` hold one program at a time and want its memory back before the next step or model.
No lowering does this on its own (:func:`writeback_core.lowering.lower` takes it as
``between_steps``): a harness that lowers thousands of small programs does not pay for it.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.export import ExportedProgram
from writeback_core.memory import drop_pages

__all__ = ["forget_toolchain_caches", "free_delegated_weights", "map_large_allocations", "return_freed_memory"]


def forget_toolchain_caches() -> None:
    """Drop what torch and exir keep of a finished lowering in process-wide caches.

    Each holds graph nodes, and through them every delegate's ``submodule_program`` with
    the weights it took, for the life of the process: torch's fake-tensor dispatch cache
    (``FakeTensorMode.cache``, keyed by the arguments of the ``executorch_call_delegate``
    calls it saw), exir's ``is_same_node`` ``lru_cache``, and the module-level
    ``WhyNoPartition`` reporters partitioners keep (the last node each rejected). On a 0.5B
    decoder they kept 1.95 GB of weights alive after :meth:`Lowered.release`. All three are
    caches or diagnostics: clearing them costs a later lowering a few cache misses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()
    try:
        from executorch.exir.backend.utils import WhyNoPartition, is_same_node
    except ImportError:  # an older exir without these helpers keeps nothing of them
        return
    is_same_node.cache_clear()
    for name, module in list(sys.modules.items()):
        if not name.startswith("executorch.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, WhyNoPartition):
                value.node = None


def return_freed_memory() -> None:
    """Drop the toolchain's caches of finished lowerings (:func:`forget_toolchain_caches`),
    collect cyclic garbage now and, with glibc, hand the freed heap back to the system
    (``malloc_trim``): a program's graph copies are cycles the collector may otherwise keep
    until the next large allocation, and glibc keeps freed pages for reuse in fragments."""
    forget_toolchain_caches()
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return
    trim(0)


# glibc's mallopt parameter for the size from which an allocation is a map of its own.
_M_MMAP_THRESHOLD = -3
#: The size ``map_large_allocations`` sets.
LARGE_ALLOCATION = 4 << 20


def map_large_allocations(threshold: int = LARGE_ALLOCATION) -> bool:
    """Make every allocation of ``threshold`` bytes or more a map of its own (glibc's
    ``M_MMAP_THRESHOLD``), handed back to the system the moment it is freed; whether it was set
    (not glibc: nothing is done).

    By default glibc raises that threshold up to 32 MiB as large blocks are freed, and then
    serves the temporaries of quantizing and checking a model from its heap, which keeps them:
    exporting the 0.5B decoder (8da4w-e8) peaked at 2,909 MiB that way and at 2,173 MiB with
    this, the code otherwise the same. ``export`` and ``run`` call it first."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def _storages(value: Any) -> Iterator[torch.UntypedStorage]:
    """The storages behind a tensor: its own, or for a wrapper subclass (a quantized weight)
    those of the tensors it is made of."""
    if not isinstance(value, torch.Tensor):
        return
    flatten = getattr(value, "__tensor_flatten__", None)
    if flatten is not None and type(value) is not torch.nn.Parameter:
        names, _ = flatten()
        for name in names:
            yield from _storages(getattr(value, name))
        return
    try:
        yield value.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a subclass without a storage of its own
        return


def _tensors(programs: Iterable[ExportedProgram]) -> Iterator[Any]:
    for program in programs:
        yield from program.state_dict.values()
        yield from program.constants.values()


def free_delegated_weights(exported: ExportedProgram, kept: Iterable[ExportedProgram]) -> int:
    """Free the memory of every weight of ``exported`` that none of the programs ``kept``
    holds: once partitioned, a delegate has serialized its own copy of the weights it took and
    the exported program's are dead weight until the ``.pte`` is written. Their storages are
    emptied in place (a weight read from a mapped file gives its pages back instead), so every
    holder sees them empty: the module exported, any copy sharing its parameters, ``exported``
    itself. Call it only when nothing will read those values again (``writeback run`` computes
    eager's steps first). Returns the bytes freed."""
    keep = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for value in _tensors(kept) for s in _storages(value)]
    freed = 0
    for value in _tensors([exported]):
        for storage in _storages(value):
            pointer, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes or any(lo < pointer + nbytes and pointer < hi for lo, hi in keep):
                continue
            try:
                storage.resize_(0)
            except RuntimeError:  # not resizable: a weight read from a mapped file
                freed += drop_pages(pointer, nbytes)
                continue
            freed += nbytes
    return freed
