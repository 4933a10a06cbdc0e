"""Load a ``.pte`` and call its ``forward`` in a process of its own, without paying for a
fresh interpreter each time.

``python -m pybind_runtime.fork_loader`` (with ``PYTHONPATH`` holding ``tests/``)
imports torch and the runtime once, then for each request line on stdin
(``{"pte": PATH, "inputs": "sum" | "seed"}``) forks a child that builds its own
``Runtime``, loads the program, calls it and prints ``ran ...`` or
``ProgramError: ...``. The parent never loads a program itself, so every child
starts from the same clean state, as a fresh interpreter would; a child that
crashes (SIGSEGV, SIGABRT) or hangs dies alone, and the parent reports its exit
code as ``subprocess`` would (negative for a signal) on one JSON line. The calling
test sees the crash as a failed assertion, and pytest lives on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import torch
from writeback_core.registry import load_registry
from writeback_pybind_runtime import ProgramError, Runtime

# Seconds a child may take before SIGALRM kills it (reported as exit code -14).
CHILD_TIMEOUT = 300


def _inputs(kind: str) -> list[torch.Tensor]:
    if kind == "sum":  # test_list_items' SumOverDims
        return [torch.ones(2, 3, 4)]
    if kind == "seed":  # the blob fuzzer's cache-write program
        return [torch.tensor([5]), torch.ones(1, 2, 1, 4)]
    raise ValueError(f"unknown inputs {kind!r}")


def _child(pte: str, kind: str) -> None:
    signal.alarm(CHILD_TIMEOUT)
    runtime = Runtime(load_registry(entry_points=False))
    try:
        method = runtime.load_program(open(pte, "rb").read()).load_method("forward")
        outputs = method(_inputs(kind))
        if kind == "sum":
            print("ran", outputs[0].tolist(), flush=True)
        else:
            print("ran", flush=True)
    except ProgramError as error:
        print("ProgramError:", error, flush=True)


def _serve(requests: IO[str], replies: IO[str]) -> None:
    for line in requests:
        request = json.loads(line)
        with tempfile.TemporaryDirectory(prefix="fork-loader-") as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: its own stdout and stderr files, then exit without cleanup
                code = 0
                try:
                    with open(out, "wb") as out_file, open(err, "wb") as err_file:
                        os.dup2(out_file.fileno(), 1)
                        os.dup2(err_file.fileno(), 2)
                        sys.stdout = open(1, "w", closefd=False)
                        sys.stderr = open(2, "w", closefd=False)
                        _child(request["pte"], request["inputs"])
                        sys.stdout.flush()
                        sys.stderr.flush()
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    code = 1
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            reply = {
                "returncode": os.waitstatus_to_exitcode(status),
                "stdout": out.read_text(errors="replace"),
                "stderr": err.read_text(errors="replace"),
            }
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class ForkLoader:
    """The test side: one server process, one request at a time."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pybind_runtime.fork_loader"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def load_and_call(self, pte: Path, inputs: str) -> subprocess.CompletedProcess[str]:
        """What a fresh ``python`` loading ``pte`` and calling it would give: exit code
        (negative for a signal), stdout and stderr."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"pte": str(pte), "inputs": inputs}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the fork loader itself died (exit {self.process.wait()})"
        reply: dict[str, Any] = json.loads(line)
        return subprocess.CompletedProcess([str(pte)], reply["returncode"], reply["stdout"], reply["stderr"])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


if __name__ == "__main__":
    _serve(sys.stdin, sys.stdout)
