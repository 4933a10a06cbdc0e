"""writeback-trt-copyback: every mutated buffer engine-aliased or copied back, never lost.

For engines that, like TensorRT, write only cache-shaped updates in place and
recompute the rest: classify each buffer write before lowering
(:func:`lift_mutated_buffers`), declare the copy-back ones
(:func:`declare_copy_back`), lower, then check the prediction against what the
engine really aliased (:func:`check_aliasing`, :func:`check_markers`) and turn
the aliased ones into in-place mutations (:func:`settle_aliased`).
:func:`compile_for_engine` runs all of it. :class:`KVAliasEngine` is a real
ExecuTorch delegate that behaves this way.
"""

from __future__ import annotations

from writeback_trt_copyback.clones import peel_input_clones, peeled_input
from writeback_trt_copyback.compile import CompiledProgram, compile_for_engine
from writeback_trt_copyback.crosscheck import (
    AliasMismatchError,
    AliasSite,
    EngineAliasing,
    MarkerFaultError,
    check_aliasing,
    check_markers,
    engine_aliasing,
)
from writeback_trt_copyback.declare import (
    UninitializedCopyBackWarning,
    declare_copy_back,
    uninitialized_message,
)
from writeback_trt_copyback.derive import (
    Bounds,
    WriteStatus,
    engine_write,
    old_value_readers,
    resolve_bounds,
)
from writeback_trt_copyback.engine import BACKEND_ID, KVAliasEngine, op_excluded
from writeback_trt_copyback.lift import (
    COPY_BACK_RECORDS,
    BufferClass,
    Lifted,
    Mode,
    lift_mutated_buffers,
)
from writeback_trt_copyback.rule import TensorRTCacheRule
from writeback_trt_copyback.settle import settle_aliased

__all__ = [
    "BACKEND_ID",
    "COPY_BACK_RECORDS",
    "AliasMismatchError",
    "AliasSite",
    "Bounds",
    "BufferClass",
    "CompiledProgram",
    "EngineAliasing",
    "KVAliasEngine",
    "Lifted",
    "MarkerFaultError",
    "Mode",
    "TensorRTCacheRule",
    "UninitializedCopyBackWarning",
    "WriteStatus",
    "check_aliasing",
    "check_markers",
    "compile_for_engine",
    "declare_copy_back",
    "engine_aliasing",
    "engine_write",
    "lift_mutated_buffers",
    "old_value_readers",
    "op_excluded",
    "peel_input_clones",
    "peeled_input",
    "resolve_bounds",
    "settle_aliased",
    "uninitialized_message",
]
