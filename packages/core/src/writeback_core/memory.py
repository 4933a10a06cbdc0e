"""How much memory this machine can give a new process: the one figure every size bound
(``--cache-mib``, a model folder's size) is checked against."""

from __future__ import annotations

import os

__all__ = ["GIB", "available_memory"]

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
