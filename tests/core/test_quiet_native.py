"""Native stderr filtering (writeback_core.quiet.native_stderr_filtered) and the quiet fuzz
command: real file descriptors, a real `writeback fuzz` with worker processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CODE = """
import os, sys
from writeback_core.quiet import native_stderr_filtered
with native_stderr_filtered():
    os.write(2, b"[cpuinfo_utils.cpp:71] Reading file /sys/devices/soc0/image_version\\n")
    os.write(2, b"I 00:00:00.009343 executorch:cpuinfo_utils.cpp:87] Failed to open midr file\\n")
    os.write(2, b"E 00:00:00.010000 executorch:op_mm.cpp:40] mat1 and mat2 shapes cannot be multiplied\\n")
    sys.stderr.write("a Python warning line\\n")
print("after", file=sys.stderr)
"""


def test_native_noise_is_dropped_and_errors_come_through_in_order() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "E 00:00:00.010000 executorch:op_mm.cpp:40] mat1 and mat2 shapes cannot be multiplied",
        "a Python warning line",
        "after",
    ]


@pytest.mark.slow
def test_fuzz_with_workers_prints_no_library_noise() -> None:
    script = str(Path(sys.executable).with_name("writeback"))
    done = subprocess.run(
        [script, "fuzz", "--programs", "2", "--seed", "3", "--jobs", "2", "--no-engines"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 mismatches" in done.stdout
    for noise in ("cpuinfo_utils.cpp", "Could not load this library", "is an Enum subclass"):
        assert noise not in done.stderr, done.stderr
