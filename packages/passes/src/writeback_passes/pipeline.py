"""``to_executorch`` with the passes plugins register, early write-back among them, for a
caller who holds an ``EdgeProgramManager`` and an ``ExecutorchBackendConfig`` of their own.
(writeback's commands lower through :mod:`writeback.lowering`, which runs the same
passes the same way: :func:`writeback_core.program.run_program_passes`.)

exir's ``EdgeProgramManager.to_executorch`` inserts the write-back copies and
then runs ``ExecutorchBackendConfig.passes`` on each method's ``GraphModule``,
before its own lowering passes and memory planning. That is the one point
where a pass sees the write-backs and can still change the memory plan, so
this module hands exir a copy of the user's config whose ``passes`` list ends
with the registered ``"before_memory_planning"`` passes. exir itself is not
patched.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from writeback_core import InPlaceDecision, ProgramPass, Registry, in_place_decisions, load_registry
from writeback_core.program import as_exir_pass, backend_config, load_quantized_kernels, run_program_passes

if TYPE_CHECKING:
    from collections.abc import Mapping

    from executorch.exir import (
        EdgeProgramManager,
        ExecutorchBackendConfig,
        ExecutorchProgramManager,
    )

__all__ = ["as_exir_pass", "early_write_back_pass", "to_executorch"]


def early_write_back_pass() -> ProgramPass:
    """The early write-back pass as a ``"before_memory_planning"`` :class:`ProgramPass`.

    It must see the graph's final readers and writers, so it runs after every pass of
    this package that adds or drops one (write-backs a delegate takes in place, state
    written in place by the kernels, copies made views). A plugin's pass that edits the
    graph says ``before=("insert_write_back_early",)``. Those relations are ``optional``: a
    plugin may offer this pass without the others (early write-back alone).
    """
    from writeback_passes.early_write_back import insert_write_back_early

    earlier = ("reinplace_delegate_input_mutations", "reinplace_state_writes", "copies_as_views")
    return ProgramPass(
        name="insert_write_back_early",
        stage="before_memory_planning",
        run=insert_write_back_early,
        after=earlier,
        optional=earlier,
        reason="each write-back moved up to where its value is ready",
    )


class _Backend(enum.Enum):
    """The default of :func:`to_executorch`'s ``backend``."""

    FROM_PROGRAM = "the backend the program was partitioned for"


def to_executorch(
    edge_manager: EdgeProgramManager,
    config: ExecutorchBackendConfig | None = None,
    registry: Registry | None = None,
    *,
    backend: str | _Backend | None = _Backend.FROM_PROGRAM,
) -> ExecutorchProgramManager:
    """``edge_manager.to_executorch(config)`` with every registered program pass for the
    backend added.

    Passes come from the ``writeback_program_passes`` hook of ``registry``
    (default: ``load_registry()``), those for ``backend``: the ``BackendSpec.name``
    ``edge_manager`` was partitioned for (``None``: no backend). By default it is read
    from ``edge_manager``: the backend core's in-place decisions name, else the installed
    backend whose delegates it calls (with no delegate: the one installed backend that
    has none, ``portable``), else ``None``. ``"edge"`` passes run first, in place on
    each method's edge program. ``"before_memory_planning"`` passes run inside
    exir after its write-back copies exist: after ``config.passes`` (the
    user's own, in their order), in the registry's order. With the
    writeback-passes plugin installed that includes the early write-back
    pass (after every pass of the package that edits the graph), so the resulting
    ``.pte`` has its write-backs early. ``config`` itself is not changed; without one,
    the config :func:`writeback_core.program.backend_config` gives (named mutable buffers,
    the ``"state"`` memory plan; writeback's own lowering uses it too), so that after
    ``to_edge_transform_and_lower(ep, **writeback_core.to_edge_arguments(backend))``
    the ``.pte`` is ``lower()``'s, byte for byte.

    Every mutated state the result still copies back whole is named, with its bytes
    per call, its cause and the line to add, in one
    :class:`~writeback_core.copies.CopyLeftWarning` per method.

    :raises TypeError: a registered pass returned something exir cannot use.
    """
    from writeback_core.copies import copies_left, warn_copies_left
    from writeback_core.quiet import known_warnings_ignored

    registry = registry if registry is not None else load_registry()
    decisions = {}
    for method in edge_manager.methods:
        decisions.update(in_place_decisions(edge_manager.exported_program(method)))
    if config is None:
        load_quantized_kernels(edge_manager)
        config = backend_config(edge_manager)
    if isinstance(backend, _Backend):
        backend = _backend_of(edge_manager, registry, decisions)
    with known_warnings_ignored():  # exir's notes that are harmless here, as lower() silences them
        program = run_program_passes(edge_manager, config, registry, backend)
    for method in program.methods:
        warn_copies_left(copies_left(decisions, program.exported_program(method), backend), method)
    return program


def _backend_of(
    edge_manager: EdgeProgramManager, registry: Registry, decisions: Mapping[str, InPlaceDecision]
) -> str | None:
    """The backend ``edge_manager`` was partitioned for, as :func:`to_executorch` reads it."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    named = {decision.backend for decision in decisions.values()}
    if len(named) == 1:
        return named.pop()
    ids = {
        module.backend_id
        for method in edge_manager.methods
        for _, module, _ in get_lowered_submodules(edge_manager.exported_program(method).graph_module)
    }
    names = [
        spec.name
        for spec in registry.backends().values()
        if spec.backend_id in ids or (not ids and not spec.backend_id)
    ]
    return names[0] if len(names) == 1 else None
