"""The differential oracle: eager PyTorch against lowered programs, call by call.

:func:`check_program` builds a :class:`~writeback_testing.program_spec.ProgramSpec`,
runs it eagerly for ``calls`` (>= 3) calls, recording every output and every
piece of state after each call, and compares each :class:`Target` against
that record. Every target lowers the program through the one lowering path
users get (:mod:`writeback_core.lowering`: the same export, partitioning,
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
too (``EXTENSION POINT`` in ``targets``): a backend's lowering (the contract suite) and
each aliasing engine's copy-back path (``writeback_testing.engines``). A
target that cannot take a program raises :class:`TargetSkipped`, which is
recorded with its reason, never counted as a pass.

The eager reference refuses programs whose in-place writes read what they
write (``writeback_testing.overlap``): eager's answer depends on the
kernel's element order there, so nothing can be compared with it.

A mismatch raises :class:`ProgramMismatch`, whose message is the program's
source (a complete module) followed by what differed, where, and whether the
same program is also wrong without writeback's passes (an upstream bug).

What is compared lives in ``observations`` (:class:`Observation`, the eager run,
:func:`compare_observations`), the lowering per memory plan in ``lowered_plans``
(:class:`Lowerings`) and the targets in ``targets``; this module holds the
check, its errors and its report, and re-exports the public names of the others.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from writeback_core.registry import Registry
from writeback_core.types import LoweringError

from writeback_testing.failure_origin import HarnessError, failure_origin
from writeback_testing.lowered_plans import Lowerings, export_built
from writeback_testing.observations import (
    DEFAULT_CALLS,
    InvalidProgram,
    Observation,
    compare_observations,
    eager_reference,
    eager_run,
)
from writeback_testing.program_spec import Built, ProgramSpec, build
from writeback_testing.targets import (
    RegistryRuntime,
    RuntimeTarget,
    StockTarget,
    Target,
    registry_runtime,
    runtime_targets,
)

__all__ = [
    "DEFAULT_CALLS",
    "UPSTREAM_VERDICTS",
    "HarnessError",
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
            _raise_if_harness(error, target, built)
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


def _raise_if_harness(error: Exception, target: Target, built: Built) -> None:
    """:class:`HarnessError` when ``error`` was raised by the harness's own code (this
    package or the target's module), which no program and no upstream library explains."""
    harness = frozenset({__name__.split(".", 1)[0], type(target).__module__})
    origin, where = failure_origin(error, harness)
    if origin == "harness":
        raise HarnessError(target.name, error, where, built.source) from error


def _fails_bare(built: Built, target: Target, calls: int) -> bool:
    """Whether ``target`` also fails with an error on the program lowered by exir alone,
    raised upstream (torch, ExecuTorch, MLX) or reported in an observation; a failure
    raised by the harness there raises :class:`HarnessError`."""
    try:
        observed = target.run(Lowerings(built, None, with_passes=False), calls)
    except Exception as error:
        _raise_if_harness(error, target, built)
        return failure_origin(error, frozenset())[0] == "upstream"
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
    from writeback_testing.program_spec import State

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
    from writeback_testing.program_spec import State

    buffers = tuple(State(n, "buffer", tuple(b.shape)) for n, b in instance.named_buffers())
    state = module.__dict__["make_state"]()
    inputs = tuple(State(f"s{len(buffers) + i}", "input", tuple(t.shape)) for i, t in enumerate(state))
    spec = dataclasses.replace(spec, states=buffers + inputs)
    built = Built(
        spec, source, module.__dict__["FuzzModule"], module.__dict__["step_inputs"], module.__dict__["make_state"]
    )
    return check_program(built, targets, registry, calls)
