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

from writeback_core import ProgramPass, Registry, in_place_decisions, load_registry
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
    has its write-backs early. ``config`` itself is not changed; without one,
    the config :func:`writeback_core.lowering.lower` uses (named mutable buffers,
    the ``"state"`` memory plan), so that after
    ``to_edge_transform_and_lower(ep, **writeback_core.to_edge_arguments(backend))``
    the ``.pte`` is ``lower()``'s, byte for byte.

    Every mutated state the result still copies back whole is named, with its bytes
    per call, its cause and the line to add, in one
    :class:`~writeback_core.copies.CopyLeftWarning` per method.

    :raises TypeError: a registered pass returned something exir cannot use.
    """
    from writeback_core import lowering
    from writeback_core.copies import copies_left, warn_copies_left
    from writeback_core.quiet import known_warnings_ignored

    registry = registry if registry is not None else load_registry()
    decisions = {}
    for method in edge_manager.methods:
        decisions.update(in_place_decisions(edge_manager.exported_program(method)))
    if config is None:
        lowering.load_quantized_kernels(edge_manager)
        config = lowering.backend_config(edge_manager)
    with known_warnings_ignored():  # exir's notes that are harmless here, as lower() silences them
        program = run_program_passes(edge_manager, config, registry)
    backend = _backend_of(program, registry)
    for method in program.methods:
        warn_copies_left(copies_left(decisions, program.exported_program(method), backend), method)
    return program


def _backend_of(program: ExecutorchProgramManager, registry: Registry) -> str | None:
    """The installed backend whose delegate ``program`` calls (``portable`` without one)."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    ids = {
        module.backend_id
        for method in program.methods
        for _, module, _ in get_lowered_submodules(program.exported_program(method).graph_module)
    }
    names = [
        spec.name
        for spec in registry.backends().values()
        if spec.backend_id in ids or (not ids and not spec.backend_id)
    ]
    return names[0] if len(names) == 1 else None
