"""The executorch release the compiled extension needs, checked when the package is imported.

The extension is compiled against one executorch release's headers and links
its ``libexecutorch.so``; another release's library has other struct layouts
and symbols, which fails late and obscurely (a missing symbol, or a crash). The
wanted release is read from this distribution's own metadata (the ``executorch==``
pin in ``pyproject.toml``), so there is one place that names it.
"""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["check_executorch", "wanted_executorch"]

DISTRIBUTION = "writeback-pybind-runtime"
_PIN = re.compile(r"^executorch\s*===?\s*([^\s;,]+)\s*$")


def wanted_executorch() -> str | None:
    """The executorch version this distribution pins, or ``None`` when its metadata is not installed."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        match = _PIN.match(requirement)
        if match:
            return match.group(1)
    return None


def check_executorch() -> None:
    """Raise ``ImportError`` naming both versions when the installed executorch is not the pinned one."""
    wanted = wanted_executorch()
    if wanted is None:
        return
    try:
        found = metadata.version("executorch")
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"writeback_pybind_runtime needs executorch {wanted}, and executorch is not installed: "
            f"pip install 'executorch=={wanted}'"
        ) from None
    # A local build label (1.5.1+cpu) names the same release.
    if found.split("+", 1)[0] != wanted:
        raise ImportError(
            f"writeback_pybind_runtime is compiled against executorch {wanted}, but executorch {found} "
            f"is installed; its runtime library differs, so the extension cannot use it. Install the "
            f"release it was built for: pip install 'executorch=={wanted}'"
        )
