"""Ctrl-C in any command prints one line, ``writeback: interrupted``, exits 130 and leaves no
process and no temporary file behind.

The subprocess tests send SIGINT to the command's whole process group, as a terminal's
Ctrl-C does: fuzz workers get it too, and must leave it to their parent.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import click
import pytest
from click.testing import CliRunner
from writeback.cli import main

INTERRUPTED = "writeback: interrupted"

# What a fresh process of this workspace's pinned torch/torchao/ExecuTorch prints to stderr on
# its own while importing and first running a program (torchao's CUDA-less build, torch's
# pytree deprecation, ExecuTorch's CPU probe). A worker that had not finished starting when
# the SIGINT came may still print them; they are not the command's output.
_LIBRARY_NOISE = re.compile(
    r"^(Failed to load .*torchao|[WI]\d{4} .*_pytree\.py|[IWE] [\d:.]+ executorch:cpuinfo_utils\.cpp:\d+\])"
)

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")


def test_ctrl_c_in_a_command_prints_one_line_and_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    from writeback_core import hookimpl, registry

    class Slow:
        writeback_name = "slow"

        @hookimpl
        def writeback_cli_commands(self, group: click.Group) -> None:
            @group.command("slow")
            def slow() -> None:
                click.echo("working")
                raise KeyboardInterrupt

    real = registry.load_registry
    monkeypatch.setattr("writeback.cli.load_registry", lambda: real(plugins=[Slow()]))
    group = type(main)(name="writeback", callback=main.callback)
    result = CliRunner().invoke(group, ["slow"])
    assert result.exit_code == 130
    assert result.stdout == "working\n"
    assert result.stderr == f"{INTERRUPTED}\n"


def _state(pid: int) -> tuple[int, str] | None:
    """``(parent pid, state letter)`` of a process, or ``None`` when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (state := _state(int(entry))) is not None and state[0] == pid:
            found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    state = _state(pid)
    return state is not None and state[1] != "Z"  # a zombie has exited; only its entry remains


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Command:
    """The ``writeback`` console script in its own process group, its output read line by
    line as it comes, each line marked by whether it came after the SIGINT."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        script = Path(sys.executable).with_name("writeback")
        self.process = subprocess.Popen(
            [str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            # A terminal starts a command with SIGINT at its default; a test runner that was
            # itself started in the background (nohup, CI) may ignore it, and a child would
            # inherit that. Start the command as a terminal would.
            preexec_fn=_default_sigint,
        )
        self.interrupted = threading.Event()
        self.lines: list[tuple[str, bool, str]] = []
        # Processes to look at when the command says it was interrupted, and those still running then.
        self.watch: list[int] = []
        self.running_when_told: list[int] | None = None
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.process.stdout), ("stderr", self.process.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, stream: IO[str]) -> None:
        for line in stream:
            if line.rstrip("\n") == INTERRUPTED:
                self.running_when_told = [p for p in self.watch if _running(p)]
            self.lines.append((name, self.interrupted.is_set(), line.rstrip("\n")))

    def wait_for(self, condition: Callable[[], bool], what: str, seconds: float = 600) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            if self.process.poll() is not None:
                self.close()
                pytest.fail(f"the command exited ({self.process.returncode}) before {what}: {self.lines}")
            if time.monotonic() > deadline:
                self.close()
                pytest.fail(f"no {what} after {seconds:.0f} s: {self.lines}")
            time.sleep(0.2)

    def ctrl_c(self) -> int:
        """SIGINT to the whole group, as a terminal sends it; the exit status."""
        self.interrupted.set()
        os.killpg(self.process.pid, signal.SIGINT)
        status = self.process.wait(timeout=300)
        self.close()
        return status

    def close(self) -> None:
        """Kill the command if it still runs; read what is left of its output."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for reader in self._readers:
            reader.join(timeout=60)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()

    def after(self) -> list[str]:
        return [f"{name}: {line}" for name, late, line in self.lines if late and not _LIBRARY_NOISE.match(line)]

    def everything(self) -> str:
        return "\n".join(line for _, _, line in self.lines)


def _gone(pids: list[int], seconds: float = 60) -> list[int]:
    """The processes of ``pids`` still running after waiting up to ``seconds`` for them to exit."""
    deadline = time.monotonic() + seconds
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _running(p)]


SLEEPS_IN_FORWARD = """
from pathlib import Path
import time
import torch

class Sleeps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        self.total.add_(x)
        Path(__file__).with_suffix(".exporting").touch()
        time.sleep(600)
        return self.total * 1

def make():
    return Sleeps(), (torch.ones(3),)
"""


@needs_proc
def test_ctrl_c_in_run_prints_one_line_leaves_no_output_and_no_temporary_dir(tmp_path: Path) -> None:
    model = tmp_path / "sleeps.py"
    model.write_text(SLEEPS_IN_FORWARD)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    pte = tmp_path / "out" / "model.pte"
    command = _Command("run", f"{model}:make", "--backend", "none", "--output", str(pte), env={"TMPDIR": str(scratch)})
    # Interrupted while exporting: the model's forward is running.
    command.wait_for(model.with_suffix(".exporting").exists, "export")
    status = command.ctrl_c()
    assert status == 130, command.everything()
    assert command.after() == [f"stderr: {INTERRUPTED}"], command.everything()
    assert "Traceback" not in command.everything()
    assert not pte.exists()
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("writeback-")]


def _spawned_workers(pid: int) -> list[int]:
    workers = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmdline:
            workers.append(child)
    return workers


def _has_loaded_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _ignores_sigint(pid: int) -> bool:
    """Whether SIGINT is in the process's ignored-signal mask (``SigIgn`` in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


@needs_proc
def test_ctrl_c_in_fuzz_jobs_2_prints_one_line_no_orphans() -> None:
    command = _Command("fuzz", "--programs", "200", "--jobs", "2", "--seed", "0")
    pid = command.process.pid
    command.wait_for(lambda: len(_spawned_workers(pid)) == 2, "two workers")
    workers = _spawned_workers(pid)
    # Past the interpreter's start, inside the imports where a SIGINT used to become a traceback.
    command.wait_for(lambda: all(_has_loaded_torch(w) for w in workers), "workers importing torch")
    # From their first instruction on, whatever they are importing: the SIGINT is the parent's.
    assert all(_ignores_sigint(w) for w in workers)
    children = _children(pid)  # the workers and multiprocessing's resource tracker
    command.watch = workers
    status = command.ctrl_c()
    assert status == 130, command.everything()
    assert command.after() == [f"stderr: {INTERRUPTED}"], command.everything()
    everything = command.everything()
    assert "Traceback" not in everything and "KeyboardInterrupt" not in everything
    # The parent stopped its workers before saying so (not left to interpreter exit).
    assert command.running_when_told == []
    assert _gone(children) == [], f"still running after the command exited: {children}"
