"""The fuzz loop: draw programs with hypothesis, check each with the oracle, shrink a failure.

:func:`run_fuzz` is what ``writeback fuzz`` and the CI tests call. With
``jobs > 1`` it starts that many worker processes, each running its own
hypothesis loop on its own seed (``seed + job``) over its share of the
programs; with ``jobs == 1`` everything runs in this process (so a test may
patch a pass and see the effect). Workers ignore SIGINT (a Ctrl-C in a terminal
reaches every process of the group): the parent gets the ``KeyboardInterrupt``,
terminates the workers, waits for them and raises it on, so nothing is left
running and no worker prints a traceback.

A failing program is shrunk by hypothesis to a minimal one; its source is the
reproducer. A program that cannot even be exported or lowered is a failure
too (a generator bug, or a pass that breaks lowering), reported the same way.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from writeback_core.quiet import native_stderr_filtered, quiet_upstream_noise

from writeback_testing.cia_ops import remember_cia_ops

__all__ = ["FuzzConfig", "FuzzFailure", "FuzzReport", "check_config", "run_fuzz"]


@dataclass(frozen=True)
class FuzzConfig:
    """What to fuzz and with what; plain data, so worker processes can receive it.

    ``plugins`` are module names registered on the registry (besides entry
    points when ``entry_points``); ``runtime`` the name of a runtime a plugin
    offers (``writeback_runtimes``; ``None``: the first offered, ``""``: stock
    ``executorch.runtime`` only). ``runtime_every`` runs the
    runtime targets on every n-th program only (1: all). ``strategy`` names
    keyword arguments of ``strategies.programs``. ``backends`` names backends
    (``writeback_backends``) whose lowering each program also goes through:
    the contract check (``contract.check_backend_contract``) compares it with
    eager PyTorch and checks each in-place answer against the program.
    ``engines`` names aliasing engines (``writeback_engines``) whose copy-back
    path each program also goes through (``engines.engine_targets``; ``None``:
    every engine offered, ``()``: none), on every ``engine_every``-th program;
    they need a runtime (not ``runtime=""``).
    """

    programs: int
    seed: int = 0
    jobs: int = 1
    entry_points: bool = True
    plugins: tuple[str, ...] = ()
    runtime: str | None = None
    runtime_every: int = 1
    calls: int = 3
    shrink: bool = True
    strategy: tuple[tuple[str, Any], ...] = ()
    backends: tuple[str, ...] = ()
    engines: tuple[str, ...] | None = None
    engine_every: int = 1


@dataclass(frozen=True)
class FuzzFailure:
    """One failing (shrunk) program: which target, and the full message with the reproducer."""

    kind: str  # "mismatch", "contract", "lowering" or "error"
    target: str | None
    message: str
    source: str | None = None  # the reproducer, when the failure carries one


@dataclass
class FuzzReport:
    """What a fuzz run did."""

    programs: int = 0
    runtime_checked: int = 0
    skipped_upstream: int = 0
    upstream_example: str | None = None
    failures: list[FuzzFailure] = field(default_factory=list)
    seconds: float = 0.0
    targets: dict[str, int] = field(default_factory=dict)
    # Programs a target could not take, by target and reason (``TargetSkipped``): such a
    # program passed the other targets and is counted in ``programs``, not in ``targets``.
    target_skips: dict[tuple[str, str], int] = field(default_factory=dict)
    # Why no engine target ran, when engines were asked for but none could run.
    engines_absent: str | None = None

    def merge(self, other: FuzzReport) -> None:
        self.programs += other.programs
        self.runtime_checked += other.runtime_checked
        self.skipped_upstream += other.skipped_upstream
        self.upstream_example = self.upstream_example or other.upstream_example
        self.failures.extend(other.failures)
        for name, count in other.targets.items():
            self.targets[name] = self.targets.get(name, 0) + count
        for key, count in other.target_skips.items():
            self.target_skips[key] = self.target_skips.get(key, 0) + count
        self.engines_absent = self.engines_absent or other.engines_absent


def _registry(config: FuzzConfig) -> Any:
    from writeback_core.registry import load_registry

    plugins = [importlib.import_module(name) for name in config.plugins]
    return load_registry(entry_points=config.entry_points, plugins=plugins)


def _runtime(config: FuzzConfig, registry: Any) -> Any:
    from writeback_testing.targets import registry_runtime

    if config.runtime == "":
        return None
    return registry_runtime(registry, config.runtime)


def _engine_targets(config: FuzzConfig, registry: Any, runtime: Any) -> tuple[list[Any], str | None]:
    """The engine targets to run, or why there are none although engines were asked for."""
    from writeback_testing.engines import engine_targets

    if config.engines == ():
        return [], None
    if not registry.engines():
        return [], None if config.engines is None else "no plugin offers an engine"
    if runtime is None:
        return [], ("no runtime to load the engines' delegates (runtime='' or none offered); engine targets not run")
    return engine_targets(registry, runtime, config.engines), None


def _run_share(config: FuzzConfig, job: int, count: int, progress: Callable[[int], None]) -> FuzzReport:
    """One hypothesis loop over ``count`` programs with seed ``config.seed + job``."""
    import warnings

    from hypothesis import HealthCheck, Phase, given, reject, seed, settings

    from writeback_testing.contract import ContractViolation, check_backend_contract
    from writeback_testing.observations import InvalidProgram
    from writeback_testing.oracle import LoweringError, ProgramMismatch, TargetError, check_program
    from writeback_testing.strategies import programs
    from writeback_testing.targets import StockTarget, Target, runtime_targets

    # torch's pytree deprecation, raised while exir deep-copies programs (the root pytest
    # configuration filters the same one); it would print once per program.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    registry = _registry(config)
    runtime = _runtime(config, registry)
    stock: list[Target] = [StockTarget()]
    name = getattr(getattr(runtime, "spec", None), "name", "runtime")
    full = stock + (runtime_targets(runtime, name) if runtime is not None else [])
    engines, engines_absent = _engine_targets(config, registry, runtime)
    report = FuzzReport(engines_absent=engines_absent)
    counter = {"n": 0, "failed": 0}
    phases = [Phase.generate, Phase.shrink] if config.shrink else [Phase.generate]

    @seed(config.seed + job)
    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(programs(**dict(config.strategy)))
    def fuzz_one(spec: Any) -> None:
        counter["n"] += 1
        # Once a program failed, every later call (hypothesis replaying and
        # shrinking it) runs all targets, so the failure cannot vanish with them.
        with_runtime = counter["failed"] > 0 or counter["n"] % config.runtime_every == 0
        with_engines = counter["failed"] > 0 or counter["n"] % config.engine_every == 0
        targets = (full if with_runtime else stock) + (engines if with_engines else [])
        try:
            result = check_program(spec, targets, registry, calls=config.calls)
            for backend in config.backends:
                checked = check_backend_contract(registry, backend, spec, runtime, calls=config.calls)
                result.targets.extend(checked.targets)
        except ProgramMismatch as error:
            if error.upstream and error.target == "stock":
                # Stock exir and executorch.runtime get it wrong without writeback
                # too: an upstream bug, reported in the summary, not a finding here.
                report.skipped_upstream += 1
                report.upstream_example = report.upstream_example or str(error)
                reject()
            counter["failed"] += 1
            raise
        except InvalidProgram:
            # Eager PyTorch refuses it (e.g. an in-place write whose source
            # overlaps its destination): not a program, draw another.
            reject()
        except (LoweringError, TargetError) as error:
            # A caller-writing runtime is writeback's own (pybind-runtime): its
            # errors are findings even when exir alone triggers them.
            ours = isinstance(error, TargetError) and error.target != "stock"
            if error.upstream and not ours:
                # torch.export / exir / the runtime fail on it with or without
                # writeback: not what this fuzzer tests. Draw another program.
                report.skipped_upstream += 1
                report.upstream_example = report.upstream_example or str(error)
                reject()
            counter["failed"] += 1
            raise
        except Exception:
            counter["failed"] += 1
            raise
        if not counter["failed"]:  # shrinking re-runs programs: those are not counted
            report.programs += 1
            report.runtime_checked += int(with_runtime and runtime is not None)
            for name in result.targets:
                report.targets[name] = report.targets.get(name, 0) + 1
            for name, reason in result.skipped.items():
                key = (name, _reason_kind(reason))
                report.target_skips[key] = report.target_skips.get(key, 0) + 1
            progress(1)

    try:
        fuzz_one()
    except ProgramMismatch as error:
        report.failures.append(FuzzFailure("mismatch", error.target, str(error), error.source))
    except ContractViolation as error:
        report.failures.append(FuzzFailure("contract", None, str(error)))
    except LoweringError as error:
        report.failures.append(FuzzFailure("lowering", None, str(error)))
    except TargetError as error:
        report.failures.append(FuzzFailure("error", error.target, str(error)))
    except Exception as error:
        report.failures.append(FuzzFailure("error", None, "".join(traceback.format_exception(error))))
    return report


def _reason_kind(reason: str) -> str:
    """A skip reason without its program-specific detail (what follows the first colon)."""
    return reason.split(":", 1)[0].strip()


def _worker(config: FuzzConfig, job: int, count: int, queue: Any) -> None:
    # Spawned workers inherit the ignored SIGINT from ``_run_parallel``; say it here too
    # for start methods that do not exec (fork, forkserver).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    quiet_upstream_noise()
    # Each program's lowerings decompose it several times; torch's set of composite ops is
    # then made once per op registry, not per decomposition (the same set: see cia_ops).
    remember_cia_ops()
    with native_stderr_filtered():
        report = _run_share(config, job, count, lambda n: queue.put(("progress", n)))
    queue.put(("done", report))


def _shares(total: int, jobs: int) -> list[int]:
    return [total // jobs + (1 if j < total % jobs else 0) for j in range(jobs)]


def check_config(config: FuzzConfig) -> None:
    """Refuse (``ValueError``) a runtime, backend or engine no plugin of ``config``'s registry
    offers, naming what is offered; nothing is generated or lowered before."""
    registry = _registry(config)
    problems = []
    if config.runtime:
        runtimes = sorted(registry.runtimes())
        if config.runtime not in runtimes:
            problems.append(
                f"no plugin offers runtime {config.runtime!r}; offered: {', '.join(runtimes) or 'none'} "
                "(or '' for stock executorch.runtime only)"
            )
    backends = sorted(registry.backends())
    unknown = [name for name in config.backends if name not in backends]
    if unknown:
        problems.append(
            f"no plugin offers backend(s) {', '.join(map(repr, unknown))}; offered: {', '.join(backends) or 'none'}"
        )
    if config.engines:
        offered = sorted(registry.engines())
        unknown = [name for name in config.engines if name not in offered]
        if unknown:
            problems.append(
                f"no plugin offers engine(s) {', '.join(map(repr, unknown))}; offered: {', '.join(offered) or 'none'}"
            )
    if problems:
        raise ValueError("; ".join(problems))


def run_fuzz(config: FuzzConfig, progress: Callable[[int], None] | None = None) -> FuzzReport:
    """Fuzz ``config.programs`` programs; ``progress(n)`` is called as programs pass.

    Each job stops at its first failure (after shrinking it). The report
    counts programs that passed every target they ran, and the programs each
    target skipped. Raises ``ValueError`` before any work for an unknown runtime,
    backend or engine (:func:`check_config`).
    """
    check_config(config)
    progress = progress or (lambda n: None)
    start = time.perf_counter()
    jobs = max(1, min(config.jobs, config.programs))
    if jobs == 1:
        report = _run_share(config, 0, config.programs, progress)
    else:
        report = _run_parallel(config, jobs, progress)
    report.seconds = time.perf_counter() - start
    return report


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in this process for the block (only the main thread can set handlers).

    A process spawned meanwhile starts with SIGINT ignored (an ignored signal stays
    ignored across exec, and Python then installs no handler for it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop(workers: Sequence[Any], queue: Any) -> None:
    """Terminate the workers still running and wait until every one has exited."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
            worker.join()
    queue.close()


def _run_parallel(config: FuzzConfig, jobs: int, progress: Callable[[int], None]) -> FuzzReport:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [
        context.Process(target=_worker, args=(config, job, count, queue), daemon=True)
        for job, count in enumerate(_shares(config.programs, jobs))
    ]
    try:
        with _sigint_ignored():
            for worker in workers:
                worker.start()
        report = _collect(workers, queue, progress)
    except BaseException:
        # Ctrl-C (or any error here): no worker may outlive this call. A second
        # Ctrl-C while they stop would leave them running: ignore it meanwhile.
        with _sigint_ignored():
            _stop(workers, queue)
        raise
    for worker in workers:
        worker.join(timeout=30)
    _stop(workers, queue)
    return report


def _collect(workers: list[Any], queue: Any, progress: Callable[[int], None]) -> FuzzReport:
    """The workers' merged reports, passing their progress on as it comes."""
    running = list(workers)
    report = FuzzReport()
    done = 0
    while done < len(workers):
        try:
            kind, payload = queue.get(timeout=5)
        except Exception:
            dead = [w for w in running if not w.is_alive() and w.exitcode not in (0, None)]
            if dead:
                codes = ", ".join(str(w.exitcode) for w in dead)
                report.failures.append(FuzzFailure("error", None, f"worker died: exit {codes}"))
                done += len(dead)
                for w in dead:
                    running.remove(w)
            continue
        if kind == "progress":
            progress(payload)
        else:
            report.merge(payload)
            done += 1
    return report


def default_jobs() -> int:
    """One job per core, at most two (CI's machines have two)."""
    return max(1, min(2, os.cpu_count() or 1))


def summary(report: FuzzReport) -> Sequence[str]:
    """Human lines describing ``report``."""
    lines = [
        f"{report.programs} programs passed in {report.seconds:.1f} s "
        f"({report.seconds / max(1, report.programs):.2f} s/program); "
        f"runtime targets on {report.runtime_checked}; "
        f"{report.skipped_upstream} drawn programs skipped (stock exir/runtime fail or are "
        f"wrong without writeback too)",
        "targets: " + ", ".join(f"{k} x{v}" for k, v in sorted(report.targets.items())),
    ]
    if report.upstream_example:
        first = report.upstream_example.splitlines()[0]
        lines.append(f"first upstream skip: {first}")
    if report.engines_absent:
        lines.append(f"engines: {report.engines_absent}")
    if report.target_skips:
        by_target: dict[str, int] = {}
        for (target, _), count in report.target_skips.items():
            by_target[target] = by_target.get(target, 0) + count
        lines.append(
            "skipped by a target (the program cannot take that path; not a pass): "
            + ", ".join(f"{t} x{n}" for t, n in sorted(by_target.items()))
        )
        for (target, reason), count in sorted(report.target_skips.items()):
            lines.append(f"  {target} x{count}: {reason}")
    if report.failures:
        lines.append(f"{len(report.failures)} failure(s):")
        for failure in report.failures:
            lines.append(f"[{failure.kind}] {failure.target or ''}\n{failure.message}")
    else:
        lines.append("0 mismatches")
    return lines
