"""writeback-testing: differential fuzzing of stateful programs and the backend contract suite.

Every target lowers through writeback's one lowering path
(:mod:`writeback_core.lowering`), so what passes here is what ``writeback run``
ships. Names are imported lazily, so ``writeback_testing.cli`` (which the
``writeback`` CLI loads through this package's plugin) costs nothing until
``writeback fuzz`` runs.

- ``program_spec``: :class:`ProgramSpec` (state, statements, outputs), rendered to
  Python source by :func:`render_source` and built by :func:`build`.
- ``strategies``: :func:`programs`, the hypothesis strategy.
- ``oracle``: :func:`check_program` (eager against every :class:`Target`),
  :class:`ProgramMismatch` (its message is a reproducer), :func:`check_source`.
- ``observations``: what a call produced, eager's record of it, and the comparison.
- ``lowered_plans``: one program through the lowering path, per memory plan.
- ``targets``: :class:`Target`, :class:`StockTarget`, :class:`RuntimeTarget`,
  :func:`runtime_targets`, :func:`registry_runtime`.
- ``engines``: :func:`engine_targets` (:class:`EngineTarget`: each program
  through an aliasing engine's copy-back path, reached through hooks).
- ``overlap``: the eager check that refuses in-place writes reading what they write.
- ``contract``: :func:`check_backend_contract`, :func:`zoo_cases`,
  :func:`backend_names`.
- ``fuzz``: :func:`run_fuzz` with a :class:`FuzzConfig` (``writeback fuzz``).
- ``pytest_plugin``: the contract as a pytest plugin a third-party backend
  enables in its own suite.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Built",
    "ContractViolation",
    "EngineTarget",
    "FuzzConfig",
    "FuzzReport",
    "ProgramMismatch",
    "ProgramSpec",
    "RuntimeTarget",
    "StockTarget",
    "Target",
    "TargetSkipped",
    "backend_names",
    "build",
    "check_backend_contract",
    "check_program",
    "check_source",
    "engine_targets",
    "programs",
    "registry_runtime",
    "render_source",
    "run_fuzz",
    "runtime_targets",
    "zoo_cases",
]

_HOME = {
    "Built": "program_spec",
    "ProgramSpec": "program_spec",
    "build": "program_spec",
    "render_source": "program_spec",
    "programs": "strategies",
    "ProgramMismatch": "oracle",
    "RuntimeTarget": "targets",
    "StockTarget": "targets",
    "Target": "targets",
    "TargetSkipped": "oracle",
    "EngineTarget": "engines",
    "engine_targets": "engines",
    "check_program": "oracle",
    "check_source": "oracle",
    "registry_runtime": "targets",
    "runtime_targets": "targets",
    "ContractViolation": "contract",
    "backend_names": "contract",
    "check_backend_contract": "contract",
    "zoo_cases": "contract",
    "FuzzConfig": "fuzz",
    "FuzzReport": "fuzz",
    "run_fuzz": "fuzz",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'writeback_testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"writeback_testing.{home}"), name)
