"""``to_executorch`` with the passes plugins register, early write-back among them.

exir's ``EdgeProgramManager.to_executorch`` inserts the write-back copies and
then runs ``ExecutorchBackendConfig.passes`` on each method's ``GraphModule``,
before its own lowering passes and memory planning. That is the one point
where a pass sees the write-backs and can still change the memory plan, so
this module hands exir a copy of the user's config whose ``passes`` list ends
with the registered ``"before_memory_planning"`` passes. exir itself is not
patched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.fx
from torch.fx.passes.infra.pass_base import PassResult
from writeback_core import ProgramPass, Registry, load_registry

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


def as_exir_pass(program_pass: ProgramPass) -> Callable[[torch.fx.GraphModule], PassResult]:
    """Adapt a pass to exir's contract: always return something with ``graph_module``."""

    def run(gm: torch.fx.GraphModule) -> PassResult:
        result = program_pass.run(gm)
        if result is None:
            return PassResult(gm, True)
        out = getattr(result, "graph_module", None)
        if not isinstance(out, torch.fx.GraphModule):
            raise TypeError(
                f"pass {program_pass.name!r} returned {type(result).__name__}; a "
                "'before_memory_planning' pass must return None or an object with a "
                "'graph_module' (such as torch.fx PassResult)"
            )
        return PassResult(out, bool(getattr(result, "modified", True)))

    run.__name__ = program_pass.name
    return run


def _run_edge_passes(edge_manager: EdgeProgramManager, passes: Sequence[ProgramPass]) -> None:
    for method in edge_manager.methods:
        program = edge_manager.exported_program(method)
        for program_pass in passes:
            result = program_pass.run(program)
            if result is not None and result is not program:
                raise TypeError(
                    f"'edge' pass {program_pass.name!r} returned a new program for method "
                    f"{method!r}; writeback_passes.to_executorch runs edge passes in place, "
                    "so the pass must edit the program it is given and return it or None"
                )


def _mark_user_inputs(edge_manager: EdgeProgramManager) -> None:
    """Record on each user-input placeholder that it is one: passes inside exir see
    only a ``GraphModule``, without the signature that tells inputs from buffers."""
    from writeback_core import meta

    for method in edge_manager.methods:
        program = edge_manager.exported_program(method)
        user_inputs = set(program.graph_signature.user_inputs)
        for node in program.graph_module.graph.nodes:
            if node.op == "placeholder" and node.name in user_inputs:
                meta.set_custom(node, meta.USER_INPUT, True)


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
    _run_edge_passes(edge_manager, registry.program_passes("edge"))
    _mark_user_inputs(edge_manager)
    added: list[Any] = [as_exir_pass(p) for p in registry.program_passes("before_memory_planning")]
    extended = dataclasses.replace(config, passes=[*config.passes, *added])
    return edge_manager.to_executorch(extended)
