"""writeback-passes: graph passes that place and drop state write-backs."""

from __future__ import annotations

from writeback_passes.early_write_back import (
    EarlyWriteBack,
    WriteBackPlacement,
    insert_write_back_early,
)
from writeback_passes.memory_report import (
    MemoryPlanReport,
    MethodPlan,
    WriteBackLifetime,
    memory_plan_report,
)
from writeback_passes.pipeline import EARLY_WRITE_BACK_ORDER, early_write_back_pass, to_executorch
from writeback_passes.reinplace_delegate import (
    IN_PLACE_OUTPUTS_SPEC,
    REINPLACE_DELEGATE_ORDER,
    DroppedWriteBack,
    KeptWriteBack,
    ReinplaceReport,
    reinplace_delegate_input_mutations,
    reinplace_delegate_pass,
)

__all__ = [
    "EARLY_WRITE_BACK_ORDER",
    "IN_PLACE_OUTPUTS_SPEC",
    "REINPLACE_DELEGATE_ORDER",
    "DroppedWriteBack",
    "EarlyWriteBack",
    "KeptWriteBack",
    "MemoryPlanReport",
    "MethodPlan",
    "ReinplaceReport",
    "WriteBackLifetime",
    "WriteBackPlacement",
    "early_write_back_pass",
    "insert_write_back_early",
    "memory_plan_report",
    "reinplace_delegate_input_mutations",
    "reinplace_delegate_pass",
    "to_executorch",
]
