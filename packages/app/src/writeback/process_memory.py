"""Process housekeeping the commands ask for by name: ``writeback run``, ``export`` and
``bench`` hold one program at a time and want its memory back before the next step or model.
No lowering does this on its own (:func:`writeback_core.lowering.lower` takes it as
``between_steps``): a harness that lowers thousands of small programs does not pay for it.
"""

from __future__ import annotations

import ctypes
import gc
import sys

__all__ = ["forget_toolchain_caches", "return_freed_memory"]


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
