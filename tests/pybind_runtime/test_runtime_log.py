"""The runtime's log sink: ExecuTorch's informational lines (its threadpool reading CPU files the
first time a kernel runs in parallel) are dropped at the source; errors still print; the level
can be lowered. Real runtime library, real `writeback run`, in fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WRITEBACK = str(Path(sys.executable).with_name("writeback"))


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The ema model's mean runs on the threadpool: the first call logs the CPU probe.
    return subprocess.run(
        [WRITEBACK, "run", "ema", "--backend", "none", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


def test_run_prints_nothing_on_stderr_by_default() -> None:
    done = _run({"WRITEBACK_RUNTIME_LOG": ""})
    assert done.returncode == 0, done.stderr
    assert "all 1 steps match eager" in done.stdout
    assert done.stderr == ""


@pytest.mark.slow
def test_info_level_shows_the_runtime_cpu_probe_lines() -> None:
    """The filter can fail: at the info level the same run prints ExecuTorch's lines."""
    done = _run({"WRITEBACK_RUNTIME_LOG": "info"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "executorch:cpuinfo_utils.cpp" in line]
    assert lines and all(line.startswith("I ") for line in lines), done.stderr


@pytest.mark.slow
def test_a_runtime_error_still_prints_at_the_default_level() -> None:
    """An index past the end, which only the kernel can see (the Method's own shape checks
    pass it): the kernel's error message reaches stderr (ExecuTorch's 'E' line) and the call
    raises; nothing informational is printed."""
    code = (
        "import torch\n"
        "from writeback_core.exporting import export_model\n"
        "from writeback_core.lowering import lower\n"
        "from writeback_pybind_runtime import Runtime\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x, i): return x[i]\n"
        "args = (torch.ones(2, 2), torch.tensor([1]))\n"
        "pte = lower(export_model(M(), args), None, plan='planned').pte\n"
        "method = Runtime.get().load_program(pte).load_method('forward')\n"
        "try:\n"
        "    method.execute([torch.ones(2, 2), torch.tensor([7])])\n"
        "except Exception as error:\n"
        "    print('raised', type(error).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "raised" in done.stdout, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if " executorch:" in line]
    assert errors and all(line.startswith("E ") for line in errors), done.stderr


def test_an_unknown_level_is_refused_naming_the_choices() -> None:
    from writeback_pybind_runtime import set_log_level

    with pytest.raises(ValueError, match="'debug', 'info' or 'error', got 'loud'"):
        set_log_level("loud")
