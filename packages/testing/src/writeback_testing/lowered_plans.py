"""One program through writeback's one lowering path, for the oracle's targets: a
:class:`Lowerings` exports a built program once (:func:`export_built`, as every command
does), partitions it once for a backend (or none) and lowers it per memory plan on demand,
with the registry's passes or (the baseline a failure is triaged against) exir alone, and
records where mutated inputs, written buffers and user outputs are among the method's outputs.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import writeback_core.lowering as lowering
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from writeback_core.exporting import export_model
from writeback_core.lowered import Lowered
from writeback_core.mutations import Mutation, find_mutations
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import InPlaceDecision, Registry, in_place_decisions
from writeback_core.types import BackendSpec, LoweringError, MemoryPlan

from writeback_testing.program_spec import Built, ProgramSpec

__all__ = ["Lowerings", "export_built"]


@dataclass
class Lowerings:
    """One program, exported once, partitioned once for ``backend`` (None: no delegate), and
    lowered per memory plan on demand (cached), all through :mod:`writeback_core.lowering`:
    the ``"state"`` plan's ``.pte`` is byte for byte what ``writeback run`` writes.

    ``registry`` None (or ``with_passes`` False) lowers with exir alone, the baseline a
    failure is triaged against. ``_edge`` may be given instead of the partition step (an
    engine's own lowering, ``writeback_lower_for_engine``).
    """

    built: Built
    registry: Registry | None
    with_passes: bool = True
    backend: BackendSpec | None = None
    _edge: Any = None
    _decisions: dict[str, InPlaceDecision] = field(default_factory=dict)
    _mutations: list[Mutation] | None = None
    _exported: ExportedProgram | None = None
    _lowered: dict[MemoryPlan, Lowered] = field(default_factory=dict)
    _layout: dict[MemoryPlan, _Layout] = field(default_factory=dict)
    seconds: float = 0.0
    # Lowerings other targets derive from this program (an engine's), keyed by the target's
    # choice of name, so that two targets sharing one lowering do it once per program.
    derived: dict[str, Any] = field(default_factory=dict)

    @property
    def backend_name(self) -> str | None:
        """The name of the backend partitioned for (None: no backend), whose passes run."""
        return self.backend.name if self.backend is not None else None

    @property
    def passes_registry(self) -> Registry | None:
        """The registry whose passes run (None: exir alone)."""
        return self.registry if self.with_passes else None

    def edge(self) -> Any:
        """The partitioned edge program (not to be consumed: :meth:`pte` lowers copies)."""
        if self._edge is None:
            start = time.perf_counter()
            try:
                exported = export_built(self.built)
            except Exception as error:
                raise LoweringError(
                    f"export failed: {type(error).__name__}: {error}\n--- program ---\n{self.built.source}",
                    upstream=True,
                ) from error
            try:
                partitioned = lowering.partition(exported, self.registry, self.backend)
                self._edge, self._decisions = partitioned.edge, partitioned.decisions
                self._mutations, self._exported = partitioned.mutations, exported
            except LoweringError as error:
                raise LoweringError(
                    f"{error}\n--- program ---\n{self.built.source}", upstream=self.backend is None
                ) from error
            self.seconds += time.perf_counter() - start
        return self._edge

    def lowered(self, plan: MemoryPlan) -> Lowered:
        """The program lowered with memory plan ``plan`` (see :data:`~writeback_core.types.MemoryPlan`)."""
        if plan not in self._lowered:
            edge = self.edge()  # timed on its own
            start = time.perf_counter()
            try:
                lowered = self._lower(plan, self.passes_registry)
            except LoweringError as error:
                raise LoweringError(
                    f"{error}\n--- program ---\n{self.built.source}", upstream=self._fails_bare(plan)
                ) from error
            self._lowered[plan] = lowered
            self._layout[plan] = _layout(lowered.program.exported_program(), self.built.spec)
            self.seconds += time.perf_counter() - start
            del edge
        return self._lowered[plan]

    def _lower(self, plan: MemoryPlan, registry: Registry | None) -> Lowered:
        """:func:`writeback_core.lowering.lower` of a copy of the partitioned program."""
        edge = self.edge()
        program = edge.exported_program()
        partitioned = lowering.Partitioned(
            _copy_edge(edge),
            dict(self._decisions) or in_place_decisions(program),
            self._mutations if self._mutations is not None else find_mutations(program),
        )
        exported = self._exported if self._exported is not None else program
        return lowering.lower(exported, registry, self.backend, plan, partitioned=partitioned)

    def pte(self, plan: MemoryPlan) -> bytes:
        """The ``.pte`` lowered with memory plan ``plan``."""
        return self.lowered(plan).pte

    def _fails_bare(self, plan: MemoryPlan) -> bool | None:
        """Whether lowering fails without writeback's passes too."""
        if self.passes_registry is None:
            return True
        try:
            self._lower(plan, None)
        except LoweringError:
            return True
        return False

    def program(self, plan: MemoryPlan) -> Any:
        """The ``ExecutorchProgramManager`` behind :meth:`pte`."""
        return self.lowered(plan).program

    def layout(self, plan: MemoryPlan) -> _Layout:
        self.lowered(plan)
        return self._layout[plan]


def _copy_edge(edge: Any) -> Any:
    # exir's to_executorch edits the edge program's signature in place
    # (insert_write_back_for_buffers_pass): lower a copy each time.
    with known_warnings_ignored():
        return copy.deepcopy(edge)


@dataclass(frozen=True)
class _Layout:
    """Where things are among a method's runtime outputs and inputs."""

    mutated_inputs: tuple[str, ...]  # state names of USER_INPUT_MUTATION outputs, in order
    mutated_buffers: tuple[str, ...]  # buffer FQNs the program writes
    n_outputs: int


def export_built(built: Built) -> ExportedProgram:
    """Export a generated program as every command does (:func:`writeback_core.exporting.export_model`)."""
    return export_model(built.new_module(), (*built.step_inputs(0), *built.make_state()))


def _layout(program: ExportedProgram, spec: ProgramSpec) -> _Layout:
    signature = program.graph_signature
    user_inputs = [s.arg.name for s in signature.input_specs if s.kind is InputKind.USER_INPUT]
    n_step = len(user_inputs) - len(spec.inputs)
    by_placeholder = {name: spec.inputs[i - n_step].name for i, name in enumerate(user_inputs) if i >= n_step}
    mutated_inputs: list[str] = []
    mutated_buffers: list[str] = []
    n_outputs = 0
    for out in signature.output_specs:
        if out.kind is OutputKind.BUFFER_MUTATION:
            mutated_buffers.append(str(out.target))
            continue
        n_outputs += 1
        if out.kind is OutputKind.USER_INPUT_MUTATION:
            mutated_inputs.append(by_placeholder[str(out.target)])
    return _Layout(tuple(mutated_inputs), tuple(mutated_buffers), n_outputs)
