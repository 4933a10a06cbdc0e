"""Runs what can crash the process (threads racing on one method, a program whose
file is truncated under it) away from pytest, and prints one JSON line.

``python -m pybind_runtime.isolated_worker MODE PTE [PTE ...]`` with ``PYTHONPATH``
holding ``tests/``. A crash (SIGSEGV, SIGBUS) kills this process, which the
calling test sees as a negative exit code instead of losing pytest.

Modes:

- ``shared-method``: four threads call one ``Method`` of each PTE; prints the
  count of each outcome: ``correct``, ``busy`` (the RuntimeError a busy method
  raises), ``wrong`` (a value that differs from eager) and ``other`` (any other
  exception), and the first messages of the last two.
- ``separate-methods``: four threads each load their own ``Method`` of one
  ``Program`` per PTE and call it; prints the same counts.
- ``truncate``: loads the PTE's method from its path, truncates the file to 0
  bytes, then calls it; rewrites the file with other bytes and calls
  again; prints whether every output matched eager.
- ``truncate-before-method``: loads the PTE from its path, cuts or rewrites the
  file (modification time moved on, or set back after a same-size rewrite), then
  loads the method; prints the error
  each attempt raised (``None`` if it loaded).
- ``cut-while-mapped``: loads the PTE from its path and, as a delegate does while
  a method loads, maps the bytes after its program flatbuffer; cuts the file (to
  half, then to 0 bytes) before they are read; prints the error each attempt
  raised (``None`` if none).
- ``cut-after-kept``: the same bytes, kept past the end of the load; the file is
  cut to 0 bytes and rewritten with other bytes, then they are read again;
  prints whether both reads equal the file's original bytes.
- ``mapped-constants``: ``TableLookup`` lowered with the doubler delegate, loaded from
  its path; prints whether the file is mapped after ``load_program``, whether a call
  matches eager, then cuts the file to half its size and calls again: prints the
  error and whether the state input and the output buffer kept their values.
- ``cut-while-running``: the same program, the doubler's ``execute`` cutting the file
  to 0 bytes in the middle of the call (before the table is read); prints the
  error of that call and of the next one.
- ``constant-output``: ``TableOutput`` (its table returned as an output), called with
  ``clone_outputs=False``; cuts the file to 0 bytes and reads the output again: prints
  whether both reads equal the table.
- ``numpy-view-of-blob``: a doubler delegate taking its blob as a memoryview and keeping
  a numpy array over it; after the load the file is cut to 0 bytes and rewritten:
  prints whether the array still holds the blob.
- ``sigbus-sent-while-loading``: a Python signal handler for SIGBUS, then a
  program with the doubler delegate whose ``init`` sends the process SIGBUS;
  prints how many times the handler ran, whether it is still installed, and
  whether the loaded method doubles.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from writeback_core.registry import load_registry
from writeback_pybind_runtime import Method, Program, ProgramError, Runtime, _pte

THREADS = 4
CALLS = 30


class StatefulMLP(torch.nn.Module):
    """``state += x``, then a few 64x64 layers over it: long enough per call for
    threads to overlap, with weights in the program's constant segment."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.weight = torch.nn.Parameter(torch.randn(64, 64, generator=generator) / 8)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(x)
        y = state
        for _ in range(6):
            y = torch.tanh(y @ self.weight)
        return y.sum(1)


EXAMPLE = (torch.zeros(16, 64), torch.zeros(16, 64))


class TableLookup(torch.nn.Module):
    """``state += 1``, then rows of a 12 MiB table scaled by twice ``scale`` (``scale +
    scale``: the doubler delegate's partition, run in Python in the middle of the
    call). The table is the program's constant segment, over the size the runtime maps
    from the file instead of reading it, and is read whole after the delegate ran."""

    ROWS, WIDTH = 3072, 1024

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(11)
        self.table = torch.nn.Parameter(torch.randn(self.ROWS, self.WIDTH, generator=generator))

    def forward(self, rows: torch.Tensor, scale: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(1.0)
        doubled = scale + scale
        return torch.nn.functional.embedding(rows, self.table * doubled) + state


class TableOutput(torch.nn.Module):
    """Returns its 12 MiB table (a mapped constant) as an output, beside ``x + 1``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = TableLookup().table

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.table, x + 1


TABLE_EXAMPLE = (torch.tensor([0, 5, 3071]), torch.ones(1), torch.zeros(3, 1024))


def _eager_step(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = StatefulMLP()(x, state)
    return out


class _Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.messages: list[str] = []

    def add(self, outcome: str, message: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if message is not None and len(self.messages) < 5:
                self.messages.append(message)


def _worker(source: Method | Program, seed: int, tally: _Tally, start: threading.Barrier) -> None:
    """Calls ``source`` (a method, or a program to load this thread's own method of)
    CALLS times with this thread's own input and state, checking each result and the
    state against eager. A busy refusal changes nothing, so the eager state advances
    only on calls that ran."""
    method = source if isinstance(source, Method) else source.load_method("forward")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed))
    state = torch.zeros(16, 64)
    expected_state = torch.zeros(16, 64)
    start.wait()
    for k in range(CALLS):
        try:
            out = method([x, state])[1] if k % 2 else method.execute([x, state])[1]
        except RuntimeError as error:
            if "in use by another call" in str(error):
                tally.add("busy")
            else:
                tally.add("other", f"{type(error).__name__}: {error}")
            continue
        except Exception as error:  # anything else is a failure the test reports
            tally.add("other", f"{type(error).__name__}: {error}")
            continue
        expected = _eager_step(x, expected_state)
        if torch.allclose(out, expected, rtol=1e-4, atol=1e-5) and torch.allclose(state, expected_state):
            tally.add("correct")
        else:
            diff = (out - expected).abs().max().item()
            tally.add("wrong", f"thread {seed} call {k}: output off by {diff}")
            state.copy_(expected_state)  # resynchronise, so one wrong call counts once


def _run_threads(source: Method | Program, tally: _Tally) -> None:
    start = threading.Barrier(THREADS)
    threads = [threading.Thread(target=_worker, args=(source, t + 1, tally, start)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def shared_method(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    tally = _Tally()
    for path in paths:
        _run_threads(runtime.load_program(path).load_method("forward"), tally)
    return {"counts": dict(tally.counts), "messages": tally.messages}


def separate_methods(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    tally = _Tally()
    for path in paths:
        # Each thread loads its own method, concurrently with the others' calls.
        _run_threads(runtime.load_program(path), tally)
    return {"counts": dict(tally.counts), "messages": tally.messages}


def truncate(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    results = []
    import executorch.runtime  # noqa: F401  (registers ExecuTorch's XnnpackBackend in the shared registry)

    for path in paths:
        size = os.path.getsize(path)
        method = runtime.load_program(path).load_method("forward")
        os.truncate(path, 0)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
        state, expected_state = torch.zeros(16, 64), torch.zeros(16, 64)
        matched = []
        for step in range(2):
            if step == 1:
                with open(path, "wb") as handle:
                    handle.write(b"\xff" * size)  # other bytes of the same size
            out = method([x, state])[1]
            expected = _eager_step(x, expected_state)
            matched.append(
                bool(torch.allclose(out, expected, rtol=1e-4, atol=1e-5) and torch.equal(state, expected_state))
            )
        results.append(matched)
    return {"matched": results}


def truncate_before_method(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    import executorch.runtime  # noqa: F401  (registers ExecuTorch's XnnpackBackend in the shared registry)

    errors: list[str | None] = []
    for path in paths:
        original = Path(path).read_bytes()
        for change in ("cut", "zero", "rewrite", "rewrite-time-restored"):
            Path(path).write_bytes(original)
            program = runtime.load_program(path)
            stat = os.stat(path)
            if change == "cut":
                os.truncate(path, len(original) // 2)
            elif change == "zero":
                os.truncate(path, 0)
            else:  # rewritten in place, same size
                with open(path, "r+b") as handle:
                    handle.write(b"\xff" * len(original))
            if change == "rewrite-time-restored":
                # Other bytes at the same size, the modification time set back to the
                # nanosecond: only the status-change time, which no call sets back, moved.
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            else:
                # A modification time the file system's clock would not have moved yet.
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
            try:
                program.load_method("forward")
                errors.append(None)
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}")
        Path(path).write_bytes(original)
    return {"errors": errors}


def _after_program(data: bytes) -> int:
    """Where the bytes after the program flatbuffer (its segments) start."""
    start = _pte.program_prefix_size(data[:32])
    assert start is not None and start < len(data), "the program has no segments"
    return start


def cut_while_mapped(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    errors: list[str | None] = []
    for path in paths:
        original = Path(path).read_bytes()
        start = _after_program(original)
        for cut in (len(original) // 2, 0):
            Path(path).write_bytes(original)
            program = runtime.load_program(path)
            try:
                program._native._read_as_delegate(
                    start, len(original) - start, functools.partial(os.truncate, path, cut), lambda: None
                )
                errors.append(None)
            except ProgramError as error:
                errors.append(f"{type(error).__name__}: {error}")
        Path(path).write_bytes(original)
    return {"errors": errors}


def _cut_and_rewrite(path: str, size: int) -> None:
    """Cut ``path`` to 0 bytes, then write ``size`` other bytes into it."""
    os.truncate(path, 0)
    with open(path, "wb") as handle:
        handle.write(b"\xff" * size)


def cut_after_kept(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    same: list[bool] = []
    for path in paths:
        original = Path(path).read_bytes()
        start = _after_program(original)

        program = runtime.load_program(path)
        while_loading, once_loaded = program._native._read_as_delegate(
            start, len(original) - start, lambda: None, functools.partial(_cut_and_rewrite, path, len(original))
        )
        same.append(while_loading == once_loaded == original[start:])
        Path(path).write_bytes(original)
    return {"same": same}


def sigbus_sent_while_loading(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    from .doubler import BACKEND_ID, DoublerDelegate

    class SigbusOnInit(DoublerDelegate):
        """The doubler, sending its own process SIGBUS from ``init`` (inside the method load)."""

        def init(self, processed: bytes, compile_specs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGBUS)
            return super().init(processed, compile_specs)

    received: list[int] = []

    def handler(signo: int, frame: object) -> None:
        received.append(signo)

    signal.signal(signal.SIGBUS, handler)
    runtime.use_delegates({BACKEND_ID: SigbusOnInit()})
    method = runtime.load_program(paths[0]).load_method("forward")
    x = torch.arange(6.0).reshape(2, 3)
    doubled = bool(torch.equal(method([x])[0], 2 * x))
    return {"received": len(received), "kept": signal.getsignal(signal.SIGBUS) is handler, "doubled": doubled}


def _maps(path: str) -> bool:
    """Whether ``path`` is mapped into this process."""
    return any(line.rstrip().endswith(os.path.realpath(path)) for line in Path("/proc/self/maps").open())


def _table_call(method: Method) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call of ``TableLookup``'s method and eager's answer; returns the output,
    eager's output and the state the call was given."""
    rows, scale = torch.tensor([0, 5, 3071]), torch.tensor([0.5])
    state, expected_state = torch.zeros(3, 1024), torch.zeros(3, 1024)
    with torch.no_grad():
        expected = TableLookup()(rows, scale, expected_state)
    out = method([rows, scale, state])[-1]
    return out, expected, state


def mapped_constants(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    from .doubler import BACKEND_ID, DoublerDelegate

    runtime.use_delegates({BACKEND_ID: DoublerDelegate()})
    path = paths[0]
    size = os.path.getsize(path)
    program = runtime.load_program(path)
    mapped = _maps(path)
    method = program.load_method("forward")
    out, expected, state = _table_call(method)
    matched = bool(torch.allclose(out, expected) and torch.equal(state, torch.ones(3, 1024)))
    kept_out = out.clone()
    os.truncate(path, size // 2)
    error = None
    try:
        method([torch.tensor([1, 2, 3]), torch.tensor([3.0]), state])
    except ProgramError as caught:
        error = f"{type(caught).__name__}: {caught}"
    unchanged = bool(torch.equal(state, torch.ones(3, 1024)) and torch.equal(out, kept_out))
    return {"mapped": mapped, "matched": matched, "error": error, "unchanged": unchanged}


def cut_while_running(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    from .doubler import BACKEND_ID, DoublerDelegate

    path = paths[0]

    class CutMidCall(DoublerDelegate):
        """The doubler, cutting the program's file to 0 bytes as it runs."""

        def execute(self, handle: Any, args: Any) -> None:
            os.truncate(path, 0)
            super().execute(handle, args)

    runtime.use_delegates({BACKEND_ID: CutMidCall()})
    method = runtime.load_program(path).load_method("forward")
    errors: list[str | None] = []
    for _ in range(2):
        try:
            _table_call(method)
            errors.append(None)
        except ProgramError as caught:
            errors.append(f"{type(caught).__name__}: {caught}")
    return {"errors": errors}


def constant_output(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    path = paths[0]
    table = TableOutput().table.detach()
    method = runtime.load_program(path).load_method("forward")
    out = method([torch.zeros(2)], clone_outputs=False)[0]
    before = bool(torch.equal(out, table))
    os.truncate(path, 0)
    return {"before": before, "after": bool(torch.equal(out, table))}


def numpy_view_of_blob(runtime: Runtime, paths: list[str]) -> dict[str, object]:
    import numpy as np

    from .doubler import BACKEND_ID, BLOB, DoublerDelegate

    kept: list[Any] = []

    class KeepsView(DoublerDelegate):
        processed_as_memoryview = True

        def init(self, processed: Any, compile_specs: Any) -> Any:
            kept.append(np.frombuffer(processed, dtype=np.uint8))
            return super().init(bytes(processed), compile_specs)

    runtime.use_delegates({BACKEND_ID: KeepsView()})
    method = runtime.load_program(paths[0]).load_method("forward")
    _cut_and_rewrite(paths[0], os.path.getsize(paths[0]))
    x = torch.arange(6.0).reshape(2, 3)
    doubled = bool(torch.equal(method([x])[0], 2 * x + 1))
    return {"same": doubled and kept[0].tobytes() == BLOB}


def run_isolated(mode: str, *paths: Path) -> dict[str, Any]:
    """Run this module's ``mode`` on ``paths`` in a fresh interpreter and return its
    JSON; fails the calling test if the interpreter died."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-m", "pybind_runtime.isolated_worker", mode, *map(str, paths)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"worker died (exit {done.returncode}):\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


MODES = {
    "shared-method": shared_method,
    "separate-methods": separate_methods,
    "truncate": truncate,
    "truncate-before-method": truncate_before_method,
    "cut-while-mapped": cut_while_mapped,
    "cut-after-kept": cut_after_kept,
    "sigbus-sent-while-loading": sigbus_sent_while_loading,
    "mapped-constants": mapped_constants,
    "cut-while-running": cut_while_running,
    "constant-output": constant_output,
    "numpy-view-of-blob": numpy_view_of_blob,
}


def main(argv: list[str]) -> int:
    mode, paths = argv[0], argv[1:]
    runtime = Runtime(load_registry(entry_points=False))
    print(json.dumps(MODES[mode](runtime, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
