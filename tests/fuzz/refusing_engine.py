"""A plugin module for the fuzz tests: an aliasing engine whose lowering refuses every program.

Registered by module name (``FuzzConfig.plugins``), so worker processes can load it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.export import ExportedProgram
from writeback_core.registry import hookimpl
from writeback_core.types import AliasingEngine, EngineWrite

writeback_name = "refusing-engine"

REASON = "unsupported: this engine takes no program"


class RefusingEngine:
    """An :class:`~writeback_core.types.AliasingEngine` that aliases nothing and lowers nothing."""

    name = "refusing"
    backend_id = "RefusingBackend"

    def alias_refusal(self, write: EngineWrite) -> str | None:
        return "this engine aliases nothing"

    def aliased_io(self, processed: bytes) -> dict[str, int]:
        return {}


@hookimpl
def writeback_engines() -> Sequence[AliasingEngine]:
    return [RefusingEngine()]


@hookimpl
def writeback_lower_for_engine(engine: AliasingEngine, program: ExportedProgram) -> Any:
    return REASON if isinstance(engine, RefusingEngine) else None
