"""The differential oracle: eager PyTorch against lowered programs, call by call.

:func:`check_program` builds a :class:`~writeback_testing.program.ProgramSpec`,
runs it eagerly for ``calls`` (>= 3) calls, recording every output and every
piece of state after each call, and compares each :class:`Target` against
that record. Every target lowers the program through the one lowering path
users get (:mod:`writeback.lowering`: the same export, partitioning,
registered passes and ``to_executorch`` as ``writeback run``) and runs it in
one runtime configuration:

- ``stock``: stock ``executorch.runtime``, memory-planned inputs. It sees
  buffer mutations (read back by name) and mutated inputs as the values it
  returns (it does not write the caller's tensor; the returned value is fed
  to the next call).
- :class:`RuntimeTarget`: any runtime shaped like ``executorch.runtime``
  whose methods write mutated inputs into the caller's tensors (the
  pybind-runtime): inputs and outputs planned; the ``"state"`` plan that
  ``writeback run`` ships (inputs unplanned, so caller-owned state is used in
  place); and nothing planned, with every bindable output bound by
  ``set_output``.

Core imports no sibling package: passes come from ``writeback_program_passes``
and a runtime from ``writeback_runtimes`` (:func:`registry_runtime`), so a third party's
runtime is fuzzed the same way. Further targets are :class:`Target` objects
too (``EXTENSION POINT`` below): a backend's lowering (the contract suite) and
each aliasing engine's copy-back path (``writeback_testing.engines``). A
target that cannot take a program raises :class:`TargetSkipped`, which is
recorded with its reason, never counted as a pass.

The eager reference refuses programs whose in-place writes read what they
write (``writeback_testing.overlap``): eager's answer depends on the
kernel's element order there, so nothing can be compared with it.

A mismatch raises :class:`ProgramMismatch`, whose message is the program's
source (a complete module) followed by what differed, where, and whether the
same program is also wrong without writeback's passes (an upstream bug).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from writeback import lowering
from writeback.pipeline import ATOL, RTOL
from writeback_core.mutations import find_mutations
from writeback_core.program import LoweringError, MemoryPlan, export_model, write_back_bytes
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import InPlaceDecision, Registry, in_place_decisions
from writeback_core.types import BackendSpec

from writeback_testing.program import Built, ProgramSpec, build

__all__ = [
    "DEFAULT_CALLS",
    "UPSTREAM_VERDICTS",
    "InvalidProgram",
    "LoweringError",
    "Lowerings",
    "Observation",
    "OracleReport",
    "ProgramMismatch",
    "RegistryRuntime",
    "RuntimeTarget",
    "StockTarget",
    "Target",
    "TargetError",
    "TargetSkipped",
    "built_from_case",
    "check_program",
    "check_source",
    "compare_observations",
    "eager_reference",
    "eager_run",
    "export_built",
    "registry_runtime",
    "runtime_targets",
]

DEFAULT_CALLS = 3


@dataclass(frozen=True)
class Observation:
    """What one call produced: user outputs in order, and state by name (what the target sees).

    ``error`` set: the call raised (``"IndexError: ..."``); ``outputs`` is then empty and
    ``state`` the state after the failed call, for eager the state *before* it (what
    every target must leave: a refused call changes nothing). A call that raised is
    the last one run.
    """

    outputs: tuple[torch.Tensor, ...]
    state: dict[str, torch.Tensor]
    error: str | None = None


def _index_refusal(error: BaseException) -> bool:
    """Whether eager refused a call for an index out of range (not for anything else, such
    as an in-place write onto memory it reads, which leaves nothing to compare)."""
    text = str(error)
    return isinstance(error, IndexError) or "out of bounds" in text or "out of range" in text


def _error_text(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class InvalidProgram(ValueError):
    """The program fails in eager PyTorch itself: there is nothing to compare against."""


class TargetError(RuntimeError):
    """A target failed to load or run a program that lowered (not a wrong value: an error).

    ``upstream`` as for :class:`LoweringError`: True when the same target fails
    on the program lowered without writeback's passes too.
    """

    def __init__(self, target: str, error: BaseException, source: str, upstream: bool | None) -> None:
        self.target = target
        self.upstream = upstream
        verdict = {
            None: "not checked without writeback's passes",
            True: "fails without writeback's passes too (upstream)",
            False: "runs without writeback's passes: a writeback bug",
        }[upstream]
        super().__init__(f"{target}: {type(error).__name__}: {error} ({verdict})\n--- reproducer ---\n{source}")


class TargetSkipped(Exception):
    """A target cannot take this program (an op it does not support, a documented limit).

    Raised by :meth:`Target.run`; :func:`check_program` records ``reason`` under
    the target's name in :attr:`OracleReport.skipped` and goes on with the other
    targets. A skip is reported and counted, never counted as a pass.
    """

    def __init__(self, target: str, reason: str) -> None:
        super().__init__(f"{target}: skipped: {reason}")
        self.target = target
        self.reason = reason


# What a mismatch's triage (the same target on the program lowered without writeback's
# passes) says, for targets whose bare path is upstream exir and runtimes.
UPSTREAM_VERDICTS: dict[bool | None, str] = {
    None: "not checked without writeback's passes",
    True: "ALSO wrong without writeback's passes (upstream ExecuTorch)",
    False: "right without writeback's passes: a writeback bug",
}


class ProgramMismatch(AssertionError):
    """A target disagreed with eager PyTorch. ``str()`` is a complete reproducer.

    ``verdicts`` words the triage (``upstream``) for the target; default
    :data:`UPSTREAM_VERDICTS`.
    """

    def __init__(
        self,
        source: str,
        target: str,
        call: int,
        what: str,
        detail: str,
        upstream: bool | None = None,
        verdicts: dict[bool | None, str] | None = None,
    ) -> None:
        self.source = source
        self.target = target
        self.call = call
        self.what = what
        self.detail = detail
        self.upstream = upstream
        verdict = (verdicts or UPSTREAM_VERDICTS)[upstream]
        super().__init__(
            f"{target}: call {call}: {what} differs from eager ({verdict})\n{detail}\n"
            f"--- reproducer (a complete module; see writeback_testing.check_source) ---\n"
            f"{source}"
        )


@dataclass
class Lowerings:
    """One program, exported once, partitioned once for ``backend`` (None: no delegate), and
    lowered per memory plan on demand (cached), all through :mod:`writeback.lowering`:
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
    _lowered: dict[MemoryPlan, lowering.Lowered] = field(default_factory=dict)
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
            except LoweringError as error:
                raise LoweringError(
                    f"{error}\n--- program ---\n{self.built.source}", upstream=self.backend is None
                ) from error
            self.seconds += time.perf_counter() - start
        return self._edge

    def lowered(self, plan: MemoryPlan) -> lowering.Lowered:
        """The program lowered with memory plan ``plan`` (see :data:`~writeback_core.program.MemoryPlan`)."""
        if plan not in self._lowered:
            edge = self.edge()  # timed on its own
            start = time.perf_counter()
            try:
                program = lowering.to_executorch(
                    _copy_edge(edge), self.passes_registry, plan, backend=self.backend_name
                )
            except LoweringError as error:
                raise LoweringError(
                    f"{error}\n--- program ---\n{self.built.source}", upstream=self._fails_bare(plan)
                ) from error
            final = program.exported_program()
            self._lowered[plan] = lowering.Lowered(
                exported=edge.exported_program(),
                mutations=find_mutations(edge.exported_program()),
                decisions=dict(self._decisions) or in_place_decisions(edge.exported_program()),
                program=program,
                pte=bytes(program.buffer),
                write_back_bytes=write_back_bytes(final),
                user_input_mutations=sum(
                    1 for s in final.graph_signature.output_specs if s.kind is OutputKind.USER_INPUT_MUTATION
                ),
                backend=self.backend_name,
                plan=plan,
                passes=lowering.pass_names(self.passes_registry, self.backend_name),
                seconds=time.perf_counter() - start,
            )
            self._layout[plan] = _layout(final, self.built.spec)
            self.seconds += time.perf_counter() - start
        return self._lowered[plan]

    def pte(self, plan: MemoryPlan) -> bytes:
        """The ``.pte`` lowered with memory plan ``plan``."""
        return self.lowered(plan).pte

    def _fails_bare(self, plan: MemoryPlan) -> bool | None:
        """Whether lowering fails without writeback's passes too."""
        if self.passes_registry is None:
            return True
        try:
            lowering.to_executorch(_copy_edge(self.edge()), None, plan, backend=self.backend_name)
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
    """Export a generated program as every command does (:func:`writeback_core.program.export_model`)."""
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


def _snapshot(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        return torch.tensor(value)
    return value.detach().clone()


def eager_run(built: Built, calls: int = DEFAULT_CALLS) -> list[Observation]:
    """Run the program eagerly ``calls`` times; every output and state is cloned at once.

    :raises OverlappingWrite: an in-place write reads elements it writes, so eager's
        answer depends on iteration order (``writeback_testing.overlap``).
    """
    from writeback_testing.overlap import NoOverlappingWrites, OverlappingWrite

    module = built.new_module()
    state = built.make_state()
    observations: list[Observation] = []

    def seen() -> dict[str, torch.Tensor]:
        found = {s.name: _snapshot(module.get_buffer(s.name)) for s in built.spec.buffers}
        found.update({s.name: _snapshot(t) for s, t in zip(built.spec.inputs, state, strict=True)})
        return found

    with torch.no_grad(), NoOverlappingWrites():
        for call in range(calls):
            before = seen()
            try:
                outputs = module(*built.step_inputs(call), *state)
            except OverlappingWrite:
                raise
            except (IndexError, RuntimeError) as error:
                if not _index_refusal(error):
                    raise
                # Eager refuses this call (an index out of range): every target must refuse it
                # too and leave the state as it was before the call.
                observations.append(Observation((), before, _error_text(error)))
                break
            if isinstance(outputs, torch.Tensor):
                outputs = (outputs,)
            observations.append(Observation(tuple(_snapshot(o) for o in outputs), seen()))
    return observations


def eager_reference(built: Built, calls: int = DEFAULT_CALLS) -> list[Observation]:
    """:func:`eager_run`, or :class:`InvalidProgram` when eager PyTorch itself fails on the
    program in a way no target can be held to (an overlapping in-place write it refuses,
    or one :func:`eager_run` refuses). A call eager refuses for an index out of range
    (``IndexError``, or an "out of bounds" ``RuntimeError``) is an observation with ``error``
    (:class:`Observation`): targets must refuse it too, changing nothing."""
    try:
        observations = eager_run(built, calls)
    except Exception as error:
        raise InvalidProgram(
            f"eager PyTorch fails: {type(error).__name__}: {error}\n--- program ---\n{built.source}"
        ) from error
    return observations


class Target(Protocol):
    """One way to lower and run a program; ``run`` returns what each call produced.

    EXTENSION POINT: a backend-lowered target (MLX through
    ``to_edge_transform_and_lower`` with the backend's partitioner) or a
    copy-back engine target (``writeback_testing.engines``) implements
    this protocol and is passed to :func:`check_program` in ``targets``. A
    target that cannot take a program raises :class:`TargetSkipped`; a target
    may set ``verdicts`` (see :class:`ProgramMismatch`) when its path without
    writeback's passes is not upstream's alone.
    """

    @property
    def name(self) -> str:
        """How reports name this target."""

    def run(self, lowered: Lowerings, calls: int) -> list[Observation]:
        """Run ``calls`` calls of ``lowered``; observations hold only what this target can see."""


@dataclass(frozen=True)
class StockTarget:
    """Stock ``executorch.runtime``: buffers by name; mutated inputs through returned values."""

    name: str = "stock"

    def run(self, lowered: Lowerings, calls: int) -> list[Observation]:
        from executorch.runtime import Runtime

        pte = lowered.pte("planned")
        layout = lowered.layout("planned")
        # Keep the Program alive while its Method runs: stock executorch.runtime frees the
        # program's memory with it, and a Method left behind reads freed memory.
        program = Runtime.get().load_program(pte)
        method = program.load_method("forward")
        spec = lowered.built.spec
        state = dict(zip((s.name for s in spec.inputs), lowered.built.make_state(), strict=True))
        observations = []
        for call in range(calls):
            args = [*lowered.built.step_inputs(call), *(state[s.name] for s in spec.inputs)]
            try:
                got = list(method.execute(args))
            except Exception as error:  # refused: what state is left is compared with eager's
                seen = {name: _snapshot(t) for name, t in state.items()}
                seen.update({fqn: _snapshot(method._method.get_attribute(fqn)) for fqn in layout.mutated_buffers})
                observations.append(Observation((), seen, _error_text(error)))
                break
            n_mut = len(layout.mutated_inputs)
            for name, value in zip(layout.mutated_inputs, got[:n_mut], strict=True):
                state[name] = value.clone()
            seen = {name: _snapshot(t) for name, t in state.items()}
            for fqn in layout.mutated_buffers:
                # executorch.runtime.Method exposes only execute/metadata; the
                # ExecuTorchMethod under it reads a named mutable buffer.
                seen[fqn] = _snapshot(method._method.get_attribute(fqn))
            observations.append(Observation(tuple(_snapshot(o) for o in got[n_mut:]), seen))
        del method, program  # the Method first, then the Program it reads
        return observations


@dataclass(frozen=True)
class RuntimeTarget:
    """A runtime that writes mutated inputs into the caller's tensors (the pybind-runtime).

    ``runtime`` has ``load_program(bytes).load_method(name)``; its methods
    ``execute(inputs)``, ``metadata`` and (when ``bind_outputs``)
    ``set_output(tensor, index)``. ``plan`` picks the memory plan of graph
    inputs and outputs (:data:`~writeback_core.program.MemoryPlan`); ``bind_outputs``
    binds every output that is unplanned, not an input and returned once to a caller
    tensor before the first call.
    """

    name: str
    runtime: Any
    plan: MemoryPlan
    bind_outputs: bool = False

    def run(self, lowered: Lowerings, calls: int) -> list[Observation]:
        pte = lowered.pte(self.plan)
        layout = lowered.layout(self.plan)
        method = self.runtime.load_program(pte).load_method("forward")
        if self.bind_outputs:
            self._bind(method)
        spec = lowered.built.spec
        state = lowered.built.make_state()
        observations = []
        n_mut = len(layout.mutated_inputs)
        for call in range(calls):
            try:
                got = list(method.execute([*lowered.built.step_inputs(call), *state]))
            except Exception as error:  # refused: the caller's state must be as it was
                seen = {s.name: _snapshot(t) for s, t in zip(spec.inputs, state, strict=True)}
                observations.append(Observation((), seen, _error_text(error)))
                break
            seen = {s.name: _snapshot(t) for s, t in zip(spec.inputs, state, strict=True)}
            by_name = dict(zip(layout.mutated_inputs, got[:n_mut], strict=True))
            for name, value in by_name.items():
                # The returned mutated input must be the new state too.
                seen[f"{name} (returned)"] = _snapshot(value)
            observations.append(Observation(tuple(_snapshot(o) for o in got[n_mut:]), seen))
        return observations

    @staticmethod
    def _bind(method: Any) -> None:
        for index, out in enumerate(method.metadata.outputs):
            if out.tag != "Tensor" or out.memory_planned or out.is_input is not None or out.repeats:
                continue
            dtype = getattr(torch, str(out.dtype).split(".")[-1])
            method.set_output(torch.full(tuple(out.sizes), -7, dtype=dtype), index)


@dataclass(frozen=True)
class RegistryRuntime:
    """A runtime a plugin offers (``writeback_runtimes``), loading with the registry's delegates."""

    spec: Any  # writeback_core.types.RuntimeSpec
    registry: Registry

    def load_program(self, data: bytes) -> Any:
        return self.spec.load_program(data, self.registry.runtime_delegates())


def registry_runtime(registry: Registry, name: str | None = None) -> RegistryRuntime | None:
    """The runtime ``name`` offered through ``writeback_runtimes`` (default: the only or the
    first by name), or ``None`` when no plugin offers one."""
    runtimes = registry.runtimes()
    if name is None:
        if not runtimes:
            return None
        name = sorted(runtimes)[0]
    if name not in runtimes:
        raise KeyError(f"no runtime named {name!r}; offered: {sorted(runtimes)}")
    return RegistryRuntime(runtimes[name], registry)


def runtime_targets(runtime: Any, prefix: str = "pybind") -> list[RuntimeTarget]:
    """The three configurations of a caller-writing runtime: every input and output planned;
    caller-owned state unplanned (``"state"``, what ``writeback run`` ships); nothing planned,
    every bindable output bound by ``set_output``."""
    return [
        RuntimeTarget(f"{prefix}-planned", runtime, "planned"),
        RuntimeTarget(f"{prefix}-state", runtime, "state"),
        RuntimeTarget(f"{prefix}-unplanned-bound", runtime, "unplanned", bind_outputs=True),
    ]


def _differs(expected: torch.Tensor, got: Any) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}: {got!r}"
    if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
        return f"expected {expected.dtype} {tuple(expected.shape)}, got {got.dtype} {tuple(got.shape)}"
    try:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, equal_nan=True)
    except AssertionError as error:
        return f"expected\n{expected}\ngot\n{got}\n({str(error).splitlines()[0]})"
    return None


def compare_observations(expected: Observation, got: Observation) -> tuple[str, str] | None:
    """The first difference as ``(what, detail)``, or ``None``.

    A call eager refused must be refused (any error) with every state the target sees as
    it was before the call; a call eager answered must not raise.
    """
    if expected.error is not None and got.error is None:
        return "refusal", f"eager raised {expected.error}; the target answered instead (a silent answer)"
    if got.error is not None and expected.error is None:
        return "error", f"the target raised {got.error} where eager answers"
    if len(got.outputs) != len(expected.outputs):
        return "output count", f"expected {len(expected.outputs)}, got {len(got.outputs)}"
    for i, (e, g) in enumerate(zip(expected.outputs, got.outputs, strict=True)):
        diff = _differs(e, g)
        if diff:
            return f"output {i}", diff
    for name, value in got.state.items():
        base = name.split(" ")[0]
        if base not in expected.state:
            return f"state {name}", f"the runtime has state {name!r} that eager does not"
        diff = _differs(expected.state[base], value)
        if diff:
            where = f"state {name}" if expected.error is None else f"state {name} after the refused call"
            return where, diff if expected.error is None else f"a refused call changed it ({got.error})\n{diff}"
    return None


@dataclass
class OracleReport:
    """What :func:`check_program` ran: targets checked, seconds spent lowering and running."""

    source: str
    targets: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # target -> reason
    lowering_seconds: float = 0.0
    running_seconds: float = 0.0


def check_program(
    program: ProgramSpec | Built,
    targets: Sequence[Target] | None = None,
    registry: Registry | None = None,
    calls: int = DEFAULT_CALLS,
    triage: bool = True,
) -> OracleReport:
    """Compare ``program`` run by every target with eager PyTorch, call by call.

    :param program: a spec (built here) or a built program.
    :param targets: default ``[StockTarget()]``.
    :param registry: whose passes the pipeline runs; ``None`` runs exir alone.
    :param calls: calls per target (at least 3: state must survive twice).
    :param triage: on a mismatch, lower again without the registry's passes
        and record whether stock exir is wrong too.
    :raises ProgramMismatch: a target's output or state differs from eager.
    :raises LoweringError: the program could not be exported or lowered.

    A target that raises :class:`TargetSkipped` is recorded in the report's
    ``skipped`` with its reason, not in ``targets``.
    """
    if calls < 3:
        raise ValueError(f"calls must be at least 3 (state must be carried twice), got {calls}")
    built = program if isinstance(program, Built) else build(program)
    targets = list(targets) if targets is not None else [StockTarget()]
    expected = eager_reference(built, calls)
    lowered = Lowerings(built, registry)
    report = OracleReport(built.source)
    for target in targets:
        start = time.perf_counter()
        seconds_before = lowered.seconds
        try:
            observed = target.run(lowered, calls)
        except TargetSkipped as skip:
            report.skipped[target.name] = skip.reason
            continue
        except (LoweringError, ProgramMismatch):
            raise
        except Exception as error:
            upstream = _fails_bare(built, target, calls) if triage else None
            raise TargetError(target.name, error, built.source, upstream) from error
        report.running_seconds += time.perf_counter() - start - (lowered.seconds - seconds_before)
        failed = next((c for c, o in enumerate(observed[: len(expected)]) if o.error is not None), None)
        if failed is not None and expected[failed].error is None:
            # Raised where eager answers: an error, triaged as one (not a wrong value).
            upstream = _fails_bare(built, target, calls) if triage else None
            raise TargetError(target.name, RuntimeError(observed[failed].error), built.source, upstream)
        for call, (want, got) in enumerate(zip(expected, observed, strict=False)):
            diff = compare_observations(want, got)
            if diff is not None:
                upstream = _triage(built, target, call, calls) if triage else None
                raise ProgramMismatch(
                    built.source, target.name, call, diff[0], diff[1], upstream, getattr(target, "verdicts", None)
                )
        report.targets.append(target.name)
    report.lowering_seconds = lowered.seconds
    return report


def _fails_bare(built: Built, target: Target, calls: int) -> bool:
    """Whether ``target`` also fails with an error on the program lowered by exir alone."""
    try:
        observed = target.run(Lowerings(built, None, with_passes=False), calls)
    except Exception:
        return True
    return any(o.error is not None for o in observed)


def _triage(built: Built, target: Target, call: int, calls: int) -> bool | None:
    """Whether the same target is also wrong at ``call`` with exir alone (no writeback passes)."""
    try:
        bare = Lowerings(built, None, with_passes=False)
        observed = target.run(bare, calls)
    except Exception:
        return None
    expected = eager_run(built, calls)
    return compare_observations(expected[call], observed[call]) is not None


def built_from_case(case: Any) -> Built:
    """A zoo :class:`~writeback_core.types.ModelCase` as a :class:`Built` the oracle can run.

    :raises ValueError: the case is exported its own way (``strict``, keyword arguments,
        ``dynamic_shapes``, ``exported``), which the oracle does not reproduce.

    Its buffers and caller-owned state are read off a fresh instance; its
    "source" names the case (zoo models are code in the repository already).
    """
    from writeback_testing.program import State

    if case.exported is not None or case.strict or case.dynamic_shapes is not None or case.example_kwargs(0):
        # The oracle exports and calls positionally, non-strict (export_built): such a case
        # would be checked as another program than the one every command exports.
        raise ValueError(
            f"model {case.name!r} says how it is exported (strict, keyword arguments, dynamic shapes or "
            "its own ExportedProgram); the oracle runs cases exported positionally and non-strict only"
        )
    module = case.build()
    buffers = tuple(State(name, "buffer", tuple(b.shape)) for name, b in module.named_buffers())
    inputs = tuple(State(f"state{i}", "input", tuple(t.shape)) for i, t in enumerate(case.make_state()))
    spec = ProgramSpec(states=buffers + inputs, statements=(), outputs=(), has_x=True, has_pos=True)
    return Built(
        spec,
        f"# zoo model {case.name!r}: writeback.zoo.builtin_models()[{case.name!r}]\n",
        case.build,
        case.step_inputs,
        case.make_state,
    )


def check_source(
    source: str, targets: Sequence[Target] | None = None, registry: Registry | None = None, calls: int = DEFAULT_CALLS
) -> OracleReport:
    """Run the oracle on a reproducer's source (as a :class:`ProgramMismatch` prints it)."""
    from types import ModuleType

    module = ModuleType("writeback_fuzz_reproducer")
    exec(compile(source, "<writeback-fuzz reproducer>", "exec"), module.__dict__)
    spec = ProgramSpec(states=(), statements=(), outputs=())
    # A reproducer carries no spec: describe its state from the module itself.
    instance = module.__dict__["FuzzModule"]()
    from writeback_testing.program import State

    buffers = tuple(State(n, "buffer", tuple(b.shape)) for n, b in instance.named_buffers())
    state = module.__dict__["make_state"]()
    inputs = tuple(State(f"s{len(buffers) + i}", "input", tuple(t.shape)) for i, t in enumerate(state))
    spec = dataclasses.replace(spec, states=buffers + inputs)
    built = Built(
        spec, source, module.__dict__["FuzzModule"], module.__dict__["step_inputs"], module.__dict__["make_state"]
    )
    return check_program(built, targets, registry, calls)
