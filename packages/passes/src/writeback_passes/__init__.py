"""writeback-passes: graph passes that place and drop state write-backs.

The passes need ExecuTorch's exir (which imports torchao), so their names are
imported on first use: ``import writeback_passes`` (and its entry-point plugin,
which every ``writeback`` start loads) imports neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from writeback_core.lowering import to_executorch

    from writeback_passes.early_write_back import (
        EarlyWriteBack,
        WriteBackPlacement,
        early_write_back_pass,
        insert_write_back_early,
    )
    from writeback_passes.memory_report import (
        MemoryPlanReport,
        MethodPlan,
        WriteBackLifetime,
        memory_plan_report,
    )
    from writeback_passes.reinplace_delegate import (
        IN_PLACE_OUTPUTS_SPEC,
        DroppedWriteBack,
        KeptWriteBack,
        ReinplaceReport,
        reinplace_delegate_input_mutations,
        reinplace_delegate_pass,
    )
    from writeback_passes.reinplace_state_writes import (
        KeptStateWrite,
        ReinplacedStateWrite,
        StateWriteReport,
        reinplace_state_writes,
        state_writes_pass,
    )
    from writeback_passes.state_write_plans import IN_PLACE_KERNEL
    from writeback_passes.state_write_refusals import in_place_kernel_refusal

__all__ = [
    "IN_PLACE_KERNEL",
    "IN_PLACE_OUTPUTS_SPEC",
    "DroppedWriteBack",
    "EarlyWriteBack",
    "KeptStateWrite",
    "KeptWriteBack",
    "MemoryPlanReport",
    "MethodPlan",
    "ReinplaceReport",
    "ReinplacedStateWrite",
    "StateWriteReport",
    "WriteBackLifetime",
    "WriteBackPlacement",
    "early_write_back_pass",
    "in_place_kernel_refusal",
    "insert_write_back_early",
    "memory_plan_report",
    "reinplace_delegate_input_mutations",
    "reinplace_delegate_pass",
    "reinplace_state_writes",
    "state_writes_pass",
    "to_executorch",
]

_LAZY = {
    "EarlyWriteBack": "writeback_passes.early_write_back",
    "WriteBackPlacement": "writeback_passes.early_write_back",
    "insert_write_back_early": "writeback_passes.early_write_back",
    "MemoryPlanReport": "writeback_passes.memory_report",
    "MethodPlan": "writeback_passes.memory_report",
    "WriteBackLifetime": "writeback_passes.memory_report",
    "memory_plan_report": "writeback_passes.memory_report",
    "early_write_back_pass": "writeback_passes.early_write_back",
    # writeback's one to_executorch, core's function object itself, kept here for users' scripts.
    "to_executorch": "writeback_core.lowering",
    "IN_PLACE_OUTPUTS_SPEC": "writeback_passes.reinplace_delegate",
    "DroppedWriteBack": "writeback_passes.reinplace_delegate",
    "KeptWriteBack": "writeback_passes.reinplace_delegate",
    "ReinplaceReport": "writeback_passes.reinplace_delegate",
    "reinplace_delegate_input_mutations": "writeback_passes.reinplace_delegate",
    "reinplace_delegate_pass": "writeback_passes.reinplace_delegate",
    "KeptStateWrite": "writeback_passes.reinplace_state_writes",
    "ReinplacedStateWrite": "writeback_passes.reinplace_state_writes",
    "StateWriteReport": "writeback_passes.reinplace_state_writes",
    "reinplace_state_writes": "writeback_passes.reinplace_state_writes",
    "state_writes_pass": "writeback_passes.reinplace_state_writes",
    "IN_PLACE_KERNEL": "writeback_passes.state_write_plans",
    "in_place_kernel_refusal": "writeback_passes.state_write_refusals",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'writeback_passes' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
