"""Moved: the fuzzer and the backend contract suite are now the writeback-testing distribution.

Import :mod:`writeback_testing` (``pip install writeback-testing``, or the
``writeback-core[testing]`` extra, which installs it). This name, and its
submodules (``writeback_core.testing.oracle`` and the rest), stay importable
for code written against the old home while writeback-testing is installed;
core itself never imports it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_SUBMODULES = ("cli", "contract", "engines", "fuzz", "oracle", "overlap", "program", "strategies")

try:
    _home = importlib.import_module("writeback_testing")
except ModuleNotFoundError as error:
    raise ModuleNotFoundError(
        "writeback_core.testing moved to the writeback-testing distribution: "
        "install it (pip install writeback-testing) and import writeback_testing"
    ) from error

for _name in _SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"writeback_testing.{_name}")

__all__ = list(_home.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_home, name)
