"""``load_program(path)`` reads regular files only: a FIFO, a directory or a device is refused
with a ``ProgramError`` naming what the path is, at once (opening a FIFO for reading used to wait
for a writer forever; it runs here in a child process with a timeout, so a hang fails the test)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from writeback_pybind_runtime import ProgramError, Runtime

_CHILD = """
import sys
from writeback_pybind_runtime import ProgramError, Runtime
try:
    Runtime.get().load_program(sys.argv[1])
except ProgramError as error:
    print("refused:", error)
else:
    print("loaded")
"""


def test_load_program_refuses_a_fifo_at_once_with_a_clear_error_no_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "model.pte"
    os.mkfifo(fifo)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(fifo)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"refused: cannot open program file '{fifo}': not a regular file (a FIFO)" in done.stdout, done.stdout


@pytest.mark.parametrize(("path", "kind"), [("dir", "a directory"), ("/dev/zero", "a character device")])
def test_load_program_refuses_what_is_not_a_regular_file_naming_it(tmp_path: Path, path: str, kind: str) -> None:
    target = tmp_path if path == "dir" else Path(path)
    with pytest.raises(ProgramError, match=rf"not a regular file \({kind}\); pass the path of a \.pte file"):
        Runtime.get().load_program(target)
