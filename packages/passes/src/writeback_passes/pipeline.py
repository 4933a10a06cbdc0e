"""``to_executorch`` with the passes plugins register, early write-back among them, for a
caller who holds an ``EdgeProgramManager`` and an ``ExecutorchBackendConfig`` of their own.
(writeback's commands lower through :mod:`writeback_core.lowering`, which runs the same
passes the same way: :func:`writeback_core.lowering.run_program_passes`.)

exir's ``EdgeProgramManager.to_executorch`` inserts the write-back copies and
then runs ``ExecutorchBackendConfig.passes`` on each method's ``GraphModule``,
before its own lowering passes and memory planning. That is the one point
where a pass sees the write-backs and can still change the memory plan, so
this module hands exir a copy of the user's config whose ``passes`` list ends
with the registered ``"before_memory_planning"`` passes. exir itself is not
patched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from writeback_core import ProgramPass, Registry, load_registry
from writeback_core.lowering import as_exir_pass, run_program_passes

if TYPE_CHECKING:
    from executorch.exir import (
        EdgeProgramManager,
        ExecutorchBackendConfig,
        ExecutorchProgramManager,
    )

__all__ = ["EARLY_WRITE_BACK_ORDER", "as_exir_pass", "early_write_back_pass", "to_executorch"]

# The early write-back pass must see the graph's final readers and writers, so
# it runs after every pass that may add or drop one: in particular after the
# MLX backend's ``reinplace_delegate_input_mutations`` (which drops write-backs
# a delegate performs in place). Passes that edit the graph must use a lower
# order than this.
EARLY_WRITE_BACK_ORDER = 100


def early_write_back_pass() -> ProgramPass:
    """The early write-back pass as a ``"before_memory_planning"`` :class:`ProgramPass`."""
    from writeback_passes.early_write_back import insert_write_back_early

    return ProgramPass(
        name="insert_write_back_early",
        stage="before_memory_planning",
        run=insert_write_back_early,
        order=EARLY_WRITE_BACK_ORDER,
    )


def to_executorch(
    edge_manager: EdgeProgramManager,
    config: ExecutorchBackendConfig | None = None,
    registry: Registry | None = None,
) -> ExecutorchProgramManager:
    """``edge_manager.to_executorch(config)`` with every registered program pass added.

    Passes come from the ``writeback_program_passes`` hook of ``registry``
    (default: ``load_registry()``). ``"edge"`` passes run first, in place on
    each method's edge program. ``"before_memory_planning"`` passes run inside
    exir after its write-back copies exist: after ``config.passes`` (the
    user's own, in their order), sorted by ``(order, name)``. With the
    writeback-passes plugin installed that includes the early write-back
    pass (order :data:`EARLY_WRITE_BACK_ORDER`), so the resulting ``.pte``
    has its write-backs early. ``config`` itself is not changed.

    :raises TypeError: a registered pass returned something exir cannot use.
    """
    from executorch.exir import ExecutorchBackendConfig

    registry = registry if registry is not None else load_registry()
    config = config if config is not None else ExecutorchBackendConfig()
    return run_program_passes(edge_manager, config, registry)
