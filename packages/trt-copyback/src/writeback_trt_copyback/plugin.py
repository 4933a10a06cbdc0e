"""Entry-point plugin of writeback-trt-copyback (thin: imports core and torch only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.export import ExportedProgram
from writeback_core.mutations import Mutation
from writeback_core.registry import hookimpl
from writeback_core.types import AliasingEngine, RuntimeDelegate

writeback_name = "trt-copyback"


@hookimpl
def writeback_engines() -> Sequence[AliasingEngine]:
    # The torch-tensorrt adapter (writeback_trt_copyback.tensorrt) needs a blob reader from
    # its user, so it is built by import rather than offered here.
    from writeback_trt_copyback.engine import KVAliasEngine

    return [KVAliasEngine()]


@hookimpl
def writeback_lower_for_engine(engine: AliasingEngine, program: ExportedProgram) -> Any:
    from writeback_trt_copyback.compile import lower_for_engine
    from writeback_trt_copyback.engine import KVAliasEngine

    # Only the engine this plugin offers: another plugin's engine is its own to lower.
    if not isinstance(engine, KVAliasEngine):
        return None
    return lower_for_engine(program, engine)


@hookimpl
def writeback_runtime_delegates() -> Sequence[RuntimeDelegate]:
    from writeback_trt_copyback.kv_alias_delegate import KVAliasRuntimeDelegate

    return [KVAliasRuntimeDelegate()]


@hookimpl
def writeback_explain_columns(program: ExportedProgram, mutation: Mutation) -> dict[str, str] | None:
    from writeback_trt_copyback.alias_column import explain_columns
    from writeback_trt_copyback.engine import KVAliasEngine

    return explain_columns(program, mutation, KVAliasEngine())
