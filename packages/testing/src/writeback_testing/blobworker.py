"""The blob fuzzer's child processes (step 4 of :mod:`writeback_testing.blobfuzz`, whose
parent side starts them and reads what they print): the worker, which runs a range of mutants
and prints each one's index and path before running it (:func:`worker`), and the fork server,
which imports torch, exir and the plugins once, keeps each target's seeds and forks a worker
per request (:func:`serve`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from writeback_testing.blobcheck import Runner
from writeback_testing.blobmutants import make_mutant
from writeback_testing.blobseeds import Seed, registry_of, seeds_of

__all__ = ["ABORT_AT_ENV", "serve", "worker"]

# Set to a mutant index, makes the worker abort there (tests the crash handling).
ABORT_AT_ENV = "WRITEBACK_BLOBFUZZ_ABORT_AT"


def worker(
    target: str, seed: int, start: int, stop: int, plugins: Sequence[str], seeds: list[Seed] | None = None
) -> int:
    """Run mutants ``[start, stop)``: print ``> i path`` before each, ``= i kind detail`` after."""
    from writeback_core.quiet import quiet_upstream_noise

    quiet_upstream_noise()
    out = sys.stdout
    runner = Runner(registry_of(plugins), target, seeds)
    # Check the seeds themselves first: each unchanged program must give eager's answer.
    if start == 0:
        for k, s in enumerate(runner.seeds):
            outcome = runner.run(s, s.blob, True)
            if outcome.kind != "equal":
                out.write(json.dumps({"i": -1 - k, "path": f"{s.program}: the seed itself", **vars(outcome)}) + "\n")
    out.write("ready\n")
    out.flush()
    # The harness's own test: abort (as a crashing mutant would) at this index.
    abort_at = int(os.environ.get(ABORT_AT_ENV, "-1"))
    for index in range(start, stop):
        chosen, path, blob, unchanged = make_mutant(runner.seeds, seed, target, index, runner.fields)
        out.write(f"> {index} {path}\n")
        out.flush()
        if index == abort_at:
            os.abort()
        outcome = runner.run(chosen, blob, unchanged)
        out.write(json.dumps({"i": index, "path": path, **vars(outcome)}) + "\n")
        out.flush()
    return 0


def serve(plugins: Sequence[str]) -> int:
    """The fork server (``serve`` mode): imports torch, exir and the plugins once and keeps
    each target's seeds; per request line on stdin (``{"target", "seed", "start", "stop",
    "stderr"}``) it forks a worker that prints ``pid N``, then runs as :func:`worker` with
    those seeds, its stderr going to the request's file. When the worker ends (or dies) the
    server prints ``exit CODE`` (negative for a signal, as ``subprocess`` gives it)."""
    import torch
    from writeback_core.quiet import quiet_upstream_noise

    quiet_upstream_noise()
    # OpenMP (libgomp) is not fork-safe: a worker forked after the server ran a parallel
    # region hangs in its own first one. The server runs on one thread (no OpenMP team is
    # made); each worker goes back to the threads a fresh interpreter has.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for line in sys.stdin:
        request = json.loads(line)
        code = _serve_request(request, plugins, threads)
        sys.stdout.write(f"exit {code}\n")
        sys.stdout.flush()
    return 0


def _serve_request(request: dict[str, Any], plugins: Sequence[str], threads: int) -> int:
    own_stderr = os.dup(2)
    try:
        with open(request["stderr"], "ab") as err:
            os.dup2(err.fileno(), 2)
        try:
            seeds = seeds_of(request["target"], plugins)
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            return 1
        sys.stdout.flush()
        sys.stderr.flush()
        import torch

        pid = os.fork()
        if pid == 0:  # the worker: run the range, then exit without the server's cleanup
            code = 1
            try:
                sys.stdout.write(f"pid {os.getpid()}\n")
                torch.set_num_threads(threads)
                code = worker(request["target"], request["seed"], request["start"], request["stop"], plugins, seeds)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    finally:
        os.dup2(own_stderr, 2)
        os.close(own_stderr)
