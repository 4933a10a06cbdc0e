"""The copy-back pipeline: lift and classify, declare, lower, check, settle."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.export import ExportedProgram
from writeback_core.quiet import known_warnings_ignored
from writeback_core.types import AliasingEngine

from writeback_trt_copyback.crosscheck import EngineAliasing, check_aliasing, check_markers
from writeback_trt_copyback.declare import declare_copy_back
from writeback_trt_copyback.lift import Lifted, Mode, lift_mutated_buffers
from writeback_trt_copyback.settle import settle_aliased

__all__ = ["CompiledProgram", "compile_for_engine", "lower_for_engine"]


@dataclass
class CompiledProgram:
    """A program lowered to an aliasing engine, every buffer write accounted for.

    ``edge`` is exir's ``EdgeProgramManager`` (call ``to_executorch`` on it, or
    use :meth:`to_executorch`); ``lifted`` the classification;
    ``aliasing`` what the engine really wrote in place.
    """

    edge: Any
    lifted: Lifted
    aliasing: EngineAliasing

    def exported_program(self) -> ExportedProgram:
        """The lowered edge program; it returns what the model returns (same arity)."""
        program: ExportedProgram = self.edge.exported_program()
        return program

    @property
    def aliased(self) -> list[str]:
        """Buffers the engine writes in place (from its ``aliased_io``)."""
        return sorted(self.aliasing.buffers)

    @property
    def copy_back(self) -> list[str]:
        """Buffers the program copies back after the engine runs."""
        return sorted(b.target for b in self.lifted.buffers if b.target not in self.aliasing.buffers)

    def to_executorch(self, init_buffers: Sequence[str] = (), passes: Sequence[Any] = ()) -> Any:
        """``to_executorch`` with mutable buffers named (``Method.get_attribute`` reads them).

        :param init_buffers: placeholder-name patterns whose initial value is
            serialized (ExecuTorch's ``InitializedMutableBufferPass``); see the
            caveat in :class:`~writeback_trt_copyback.declare.UninitializedCopyBackWarning`.
        :param passes: more ``ExecutorchBackendConfig.passes``.
        """
        from executorch.exir import ExecutorchBackendConfig
        from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

        extra = [InitializedMutableBufferPass(list(init_buffers))] if init_buffers else []
        config = ExecutorchBackendConfig(emit_mutable_buffer_names=True, passes=[*extra, *passes])
        # exir edits the edge program in place while it inserts write-backs; a copy keeps
        # this method callable more than once.
        return copy.deepcopy(self.edge).to_executorch(config)


def compile_for_engine(
    program: ExportedProgram,
    engine: AliasingEngine,
    mode: Mode = Mode.PREDICT,
    partitioners: Sequence[Any] | None = None,
    dryrun: bool = False,
) -> CompiledProgram:
    """Lower ``program`` (from ``torch.export``) to ``engine`` without losing a buffer write.

    Algorithm:
      1. :func:`~writeback_trt_copyback.lift.lift_mutated_buffers` classifies
         every buffer write (``mode``).
      2. :func:`~writeback_trt_copyback.declare.declare_copy_back` declares the
         copy-back ones, so the program returns the model's own outputs again.
      3. ``to_edge_transform_and_lower`` with ``partitioners`` (default: the
         engine's own ``partitioner()``); none with ``dryrun``.
      4. :func:`~writeback_trt_copyback.crosscheck.check_markers` and
         :func:`~writeback_trt_copyback.crosscheck.check_aliasing` (both skipped
         under ``dryrun``: no engine was built, nothing to check; every buffer
         is then copied back, and ``lifted`` holds what would have been aliased).
      5. :func:`~writeback_trt_copyback.settle.settle_aliased` turns what the
         engine aliased into in-place mutations (no copy).

    The caller's ``program`` is left as it was.
    """
    from executorch.exir import EdgeCompileConfig, EdgeProgramManager, to_edge_transform_and_lower

    lifted = lift_mutated_buffers(program, engine, mode)
    # With nothing built, nothing can write a buffer in place: every buffer is copied back,
    # so the dry-run program still runs correctly (on any runtime), and `lifted` still says
    # what the engine would have aliased.
    source = lift_mutated_buffers(program, engine, Mode.KEEP_ALL) if dryrun else lifted
    declared = declare_copy_back(source.program)
    if partitioners is None:
        # Only engines that lower offer partitioner(); the AliasingEngine protocol does not declare it.
        partitioners = [] if dryrun else [engine.partitioner()]  # type: ignore[attr-defined]  # see above
    config = EdgeCompileConfig()
    with known_warnings_ignored():
        # exir's known chatter while retracing (named in writeback_core.quiet); ours are
        # raised outside this block.
        edge = to_edge_transform_and_lower(declared, partitioner=list(partitioners), compile_config=config)
    lowered = edge.exported_program()
    if mode is Mode.PREDICT and not dryrun:
        check_markers(lowered, [b.target for b in lifted.buffers if b.marked])
    aliasing = check_aliasing(lowered, engine, engines_built=not dryrun)
    settled = settle_aliased(lowered, aliasing)
    return CompiledProgram(EdgeProgramManager({"forward": settled}, compile_config=config), lifted, aliasing)


def lower_for_engine(program: ExportedProgram, engine: AliasingEngine) -> Any:
    """What this package answers to core's ``writeback_lower_for_engine``: the settled edge
    program of :func:`compile_for_engine` (``Mode.PREDICT``), or why ``engine`` refuses it."""
    return compile_for_engine(program, engine).edge
