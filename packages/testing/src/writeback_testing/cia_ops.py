"""torch's set of CompositeImplicitAutograd ops, remembered while the op registry is unchanged.

Every ``ExportedProgram.run_decompositions`` (each ``to_edge``, each decomposition to core ATen)
asks torch twice for every op that has a CompositeImplicitAutograd kernel
(``torch._export.utils._collect_all_valid_cia_ops``). torch remembers the ``aten`` namespace's
part, but walks the C++ dispatcher's whole list again for each other op namespace (about forty
once executorch is imported): some 60 ms of CPU a call; remembered, a fuzzed program takes 30%
less CPU (measurement log, 2026-12-07, commit 8082ce7).

:func:`remember_cia_ops` makes torch's three callers of it use one remembered answer, recomputed
whenever the namespaces or the dispatcher's CompositeImplicitAutograd registrations differ from
when it was computed (an op library loaded, a custom op defined or dropped): the same set as
torch's own. The test suite (tests/conftest.py) and the fuzz workers use it. What the key does
not see (nor does torch's own cache of the ``aten`` part): a Python-only CompositeImplicitAutograd
kernel (``py_impl``) put on an existing op with no C++ registration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["remember_cia_ops"]

# torch's modules that call the function, each through its own imported name.
_CALLERS = ("torch._export.utils", "torch.export.exported_program", "torch.export.decomp_utils")
_NAME = "_collect_all_valid_cia_ops"


def _remembering(compute: Callable[[], set[Any]]) -> Callable[[], set[Any]]:
    import torch

    key: tuple[tuple[str, ...], frozenset[str]] | None = None
    found: set[Any] = set()

    def collect() -> set[Any]:
        nonlocal key, found
        now = (
            tuple(torch.ops._dir),
            frozenset(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
        )
        if now != key:
            found, key = compute(), now
        return set(found)  # torch's callers get a set of their own, as from torch

    collect.__wrapped__ = compute  # type: ignore[attr-defined]  # functools' convention
    return collect


def remember_cia_ops() -> None:
    """Make torch remember its set of CompositeImplicitAutograd ops in this process (see the
    module docstring); calling it again changes nothing."""
    import importlib

    utils = importlib.import_module(_CALLERS[0])
    original = getattr(utils, _NAME)
    if hasattr(original, "__wrapped__"):
        return
    remembered = _remembering(original)
    for name in _CALLERS:
        setattr(importlib.import_module(name), _NAME, remembered)
