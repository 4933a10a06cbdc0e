"""Structure-aware fuzzing of delegate blobs and ``.pte`` execution plans: no field of a file
may crash the process.

A ``.pte`` is untrusted input, and so is every delegate blob in it. This fuzzer
starts from real ones and changes one field at a time:

1. **Seeds.** Small real programs (:data:`SEED_PROGRAMS`: a decoder step's cache
   write, a mix of embedding, cat, where, cumsum and matmul) are exported and
   lowered through writeback's one lowering path, for every backend and every
   aliasing engine the registry offers (MLX, the kv-alias copy-back engine, a
   third party's backend: whatever plugins are loaded), and to a plain ``.pte``.
   For each delegate call of the lowered edge program, the seed keeps its blob,
   its compile specs, the tensors the call receives and eager PyTorch's answer
   (exir runs the partition's own graph eagerly). A ``.pte`` seed keeps the
   program, its inputs and eager's outputs of the module.
2. **Mutants.** Mutant ``i`` of a target is drawn from ``Random(f"{seed}:{target}:{i}")``
   alone, so any one can be made again. A JSON blob (or the zlib-compressed JSON
   header of a ``MAGIC | length | zlib(JSON) | data`` blob) is decoded and one
   field is changed: an int to a boundary (-1, 0, the value +-1, 2**31, 2**63,
   a 5,000-digit integer...), a string to another name of the same blob (a
   reference to another entry), a list shortened, lengthened, reordered or
   emptied, an object's key dropped or added, any value to another JSON type;
   or the bytes are truncated, flipped or the length field changed. A ``.pte``
   has one scalar of its execution plan changed in place
   (:func:`writeback_testing.ptefields.plan_fields`: value kinds, dims, sizes,
   dim orders, dtypes, memory offsets, operator and value indices...). Some
   mutants only re-encode the same JSON: they must give eager's answer.
3. **Oracle.** Each mutant runs the real path (the delegate's ``init``,
   ``execute``, ``destroy``; the runtime's ``load_program``, ``load_method`` and a
   call) and its outcome is one of: ``refused`` (a clean error: ``BlobError``,
   or a ``ValueError``/``IndexError``/``TypeError``/``RuntimeError`` that the code
   raised on purpose or a kernel raised, as eager would); ``ran`` (a changed
   program ran); ``equal`` (an unchanged program gave eager's answer). Findings:
   ``wrong`` (an unchanged program's answer differs from eager's), ``escaped``
   (any other exception type, Python's own messages such as ``list index out of
   range`` or ``invalid literal for int()``, or an MLX error surfacing as is),
   ``crash`` (the process died: signal, abort) and ``hang``.
4. **Workers.** Mutants run in a worker process that runs a range of mutants,
   printing each mutant's index and path before running it; when it dies the
   parent records the crash with that mutant's reproduction and starts a new
   worker after it. Workers are forked by a fork server (``python -m
   writeback_testing.blobfuzz serve``, one per set of plugins and environment,
   living as long as the process that started it), which imports torch and exir
   and builds each target's seeds once: a new worker, after a crash or for the
   next run, costs a fork, not a fresh interpreter and a lowering.
   (``python -m writeback_testing.blobfuzz worker`` runs a range in a process
   of its own.)

Reproduce one mutant in the current process:
``python -m writeback_testing.blobfuzz repro --target TARGET --seed S --index I``.

Each step has a module of its own: ``blobseeds`` (1), ``blobmutants`` (2), ``blobcheck``
(3) and ``blobworker`` (4, the worker and the fork server). This module is the parent
side (:func:`run_blob_fuzz`, :class:`BlobFuzzReport`, the fork servers it starts and
reads) and the command line; it re-exports the public names of the others.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from writeback_testing.blobcheck import FINDINGS, Outcome, Runner, classify_error, run_mutant
from writeback_testing.blobmutants import make_mutant
from writeback_testing.blobseeds import (
    DEFAULT_PLUGINS,
    Seed,
    build_seeds,
    installed_plugins,
    registry_of,
    seeds_of,
    targets_of,
)
from writeback_testing.blobworker import serve, worker

__all__ = [
    "DEFAULT_PLUGINS",
    "BlobFuzzReport",
    "Finding",
    "Outcome",
    "Seed",
    "build_seeds",
    "classify_error",
    "installed_plugins",
    "make_mutant",
    "run_blob_fuzz",
    "run_mutant",
    "seeds_of",
]


@dataclass
class Finding:
    """A mutant whose outcome is a finding, with all it takes to make it again."""

    target: str
    seed: int
    index: int
    path: str
    outcome: Outcome

    def reproduction(self) -> str:
        return (
            f"python -m writeback_testing.blobfuzz repro --target {self.target} --seed {self.seed} --index {self.index}"
        )

    def __str__(self) -> str:
        return (
            f"{self.outcome.kind} in {self.target} mutant {self.index} (seed {self.seed}): {self.path}\n"
            f"  {self.outcome.detail}\n  reproduce: {self.reproduction()}"
        )


@dataclass
class BlobFuzzReport:
    """Counts of outcomes per target, every finding, and the time taken."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    restarts: int = 0

    @property
    def mutants(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    def summary(self) -> str:
        lines = [
            f"{self.mutants} blob mutants in {self.seconds:.1f} s "
            f"({self.mutants / max(self.seconds, 1e-9):.0f}/s), {len(self.findings)} findings, "
            f"{self.restarts} worker restarts"
        ]
        for target, counts in sorted(self.counts.items()):
            lines.append(f"  {target}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        lines.extend(str(f) for f in self.findings)
        return "\n".join(lines)


class _Lines:
    """Lines of a worker's stdout, each waited for at most ``timeout`` seconds."""

    def __init__(self, stream: Any) -> None:
        self.fd = stream.fileno()
        self.buffer = b""

    def next(self, timeout: float) -> str | None:
        """The next line; ``None`` at end of stream; ``TimeoutError`` when none came in time."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace")


class _Server:
    """A fork server (:func:`serve`) of this process, for one set of plugins and one environment."""

    def __init__(self, plugins: Sequence[str], env: dict[str, str] | None, stderr_path: str) -> None:
        command = [sys.executable, "-m", "writeback_testing.blobfuzz", "serve", "--plugins", ",".join(plugins)]
        # Until its first request redirects it, the server's stderr (imports) is that request's.
        with open(stderr_path, "wb") as err_file:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file, env=env
            )
        assert self.process.stdout is not None
        self.lines = _Lines(self.process.stdout)

    def request(self, **fields: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(fields) + "\n").encode())
        self.process.stdin.flush()

    def close(self) -> None:
        """End the server (it exits when its stdin closes; killed if it does not)."""
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# This process's fork servers, by plugins and environment (``None``: this process's, as
# it was when the server started); ended at exit.
_SERVERS: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...] | None], _Server] = {}


def _server(plugins: Sequence[str], env: dict[str, str] | None, stderr_path: str) -> _Server:
    key = (tuple(plugins), None if env is None else tuple(sorted(env.items())))
    server = _SERVERS.get(key)
    if server is None or server.process.poll() is not None:
        if not _SERVERS:
            atexit.register(_close_servers)
        server = _SERVERS[key] = _Server(plugins, env, stderr_path)
    return server


def _end_server(server: _Server) -> None:
    """Kill ``server`` (mid-request: its worker hung or the caller failed) and forget it."""
    for key in [k for k, v in _SERVERS.items() if v is server]:
        del _SERVERS[key]
    server.process.kill()
    server.close()


def _close_servers() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def _stderr_tail(path: str) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - 1500))
        lines = handle.read().decode("utf-8", "replace").strip().splitlines()
    return " | ".join(lines[-4:])


def run_blob_fuzz(
    targets: Sequence[str] | None = None,
    mutants: int = 1000,
    seed: int = 0,
    plugins: Sequence[str] = DEFAULT_PLUGINS,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> BlobFuzzReport:
    """Run ``mutants`` mutants of each target (default: every target the plugins offer) in
    worker processes (forked by a fork server that outlives the call: the next call with
    the same plugins and environment reuses it); a worker that dies or hangs is recorded
    as a finding and replaced by one starting after that mutant.

    :param timeout: seconds a worker may take to start (the fork server to start and
        build the seeds), and then per mutant.
    :param env: the workers' environment (default: this process's, as it was when the
        first call started the fork server).
    :param progress: called with ``(target, mutants done)`` as results arrive.
    """
    report = BlobFuzzReport()
    started = time.perf_counter()
    if targets is None:
        targets = targets_of(registry_of(plugins))
    for target in targets:
        counts = report.counts.setdefault(target, Counter())
        index = 0
        while index < mutants:
            index = _run_worker(target, seed, index, mutants, plugins, timeout, env, report, counts, progress)
    report.seconds = time.perf_counter() - started
    return report


def _run_worker(
    target: str,
    seed: int,
    start: int,
    stop: int,
    plugins: Sequence[str],
    timeout: float,
    env: dict[str, str] | None,
    report: BlobFuzzReport,
    counts: Counter[str],
    progress: Callable[[str, int], None] | None,
) -> int:
    """One worker over ``[start, stop)``, forked by this process's fork server for ``plugins``
    and ``env``; returns where the next worker starts."""
    with tempfile.NamedTemporaryFile(prefix="blobfuzz-", suffix=".stderr", delete=False) as err:
        stderr_path = err.name
    server: _Server | None = None
    worker: int | None = None
    finished = False
    try:
        server = _server(plugins, env, stderr_path)
        server.request(target=target, seed=seed, start=start, stop=stop, stderr=stderr_path)
        current: tuple[int, str] | None = None
        ready = False
        code: int | None = None
        while code is None:
            try:
                line = server.lines.next(timeout)
            except TimeoutError:
                if current is None:
                    raise RuntimeError(
                        f"the {target} worker did not start in {timeout:.0f} s: {_stderr_tail(stderr_path)}"
                    ) from None
                counts["hang"] += 1
                report.findings.append(
                    Finding(target, seed, current[0], current[1], Outcome("hang", f"no result in {timeout:.0f} s"))
                )
                report.restarts += 1
                return current[0] + 1
            if line is None:  # the server itself died
                code = server.process.wait()
            elif line.startswith("exit "):
                code = int(line[5:])
                finished = True
            elif line.startswith("pid "):
                worker = int(line[4:])
            elif line == "ready":
                ready = True
            elif line.startswith("> "):
                number, _, path = line[2:].partition(" ")
                current = (int(number), path)
            elif line.startswith("{"):
                record = json.loads(line)
                outcome = Outcome(record["kind"], record["detail"])
                if record["i"] >= 0:
                    counts[outcome.kind] += 1
                    current = None
                    if progress is not None:
                        progress(target, record["i"] + 1)
                if outcome.kind in FINDINGS:
                    report.findings.append(Finding(target, seed, record["i"], record["path"], outcome))
        if current is not None:
            signal_text = f"signal {-code}" if code < 0 else f"exit {code}"
            counts["crash"] += 1
            detail = f"the worker died ({signal_text}): {_stderr_tail(stderr_path)}"
            report.findings.append(Finding(target, seed, current[0], current[1], Outcome("crash", detail)))
            report.restarts += 1
            return current[0] + 1
        if code != 0 or not ready:
            raise RuntimeError(
                f"the {target} worker failed (exit {code}) outside any mutant: {_stderr_tail(stderr_path)}"
            )
        return stop
    finally:
        if not finished:  # a hang, or an error here: end the worker and its server
            if worker is not None:
                try:
                    os.kill(worker, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if server is not None:
                _end_server(server)
        os.unlink(stderr_path)


def _repro(target: str, seed: int, index: int, plugins: Sequence[str]) -> int:
    runner = Runner(registry_of(plugins), target)
    chosen, path, blob, unchanged = make_mutant(runner.seeds, seed, target, index, runner.fields)
    print(f"{target} mutant {index} (seed {seed}): {path}", flush=True)
    outcome = runner.run(chosen, blob, unchanged)
    print(f"{outcome.kind}: {outcome.detail}")
    return 1 if outcome.kind in FINDINGS else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m writeback_testing.blobfuzz", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["worker", "serve", "repro", "run"])
    parser.add_argument("--target", action="append", help="pte, backend:NAME or engine:NAME (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--stop", type=int, default=100)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--mutants", type=int, default=1000)
    parser.add_argument("--plugins", default=",".join(DEFAULT_PLUGINS))
    options = parser.parse_args(argv)
    plugins = [p for p in options.plugins.split(",") if p]
    if options.mode == "worker":
        return worker(options.target[0], options.seed, options.start, options.stop, plugins)
    if options.mode == "serve":
        return serve(plugins)
    if options.mode == "repro":
        return _repro(options.target[0], options.seed, options.index, plugins)
    report = run_blob_fuzz(options.target, options.mutants, options.seed, plugins)
    print(report.summary())
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
