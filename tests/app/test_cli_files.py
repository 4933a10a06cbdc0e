"""Every file the CLI writes appears whole or not at all: written to a temporary file in the
same folder and renamed into place, so a reader that has the old file mapped keeps it and a
failure or Ctrl-C mid-write leaves the old file as it was, with no temporary file behind."""

from __future__ import annotations

import mmap
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from writeback._files import WriteFailed, replacing, write_bytes
from writeback.cli import main

OLD = b"the old program, still mapped by a running process"


def _mapped(path: Path) -> tuple[mmap.mmap, int]:
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), os.fstat(file.fileno()).st_ino


def test_write_bytes_replaces_the_file_so_a_mapped_old_file_keeps_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "model.pte"
    path.write_bytes(OLD)
    mapping, inode = _mapped(path)
    new = b"N" * (3 * len(OLD))
    write_bytes(path, new)
    # Rewriting in place would have changed the mapped bytes (or, had the file shrunk, made
    # reading them a SIGBUS); a rename leaves the mapped inode alone.
    assert mapping[:] == OLD
    assert path.read_bytes() == new and path.stat().st_ino != inode
    assert os.listdir(tmp_path) == ["model.pte"]
    mapping.close()


@pytest.mark.parametrize("error", [RuntimeError("serializer bug"), KeyboardInterrupt(), OSError(28, "No space")])
def test_replacing_keeps_the_old_file_and_no_temporary_when_the_write_fails(
    tmp_path: Path, error: BaseException
) -> None:
    path = tmp_path / "model.pte"
    path.write_bytes(OLD)
    expected = WriteFailed if isinstance(error, OSError) else type(error)
    with pytest.raises(expected), replacing(path) as temporary:
        temporary.write_bytes(b"half a progr")
        raise error
    assert path.read_bytes() == OLD
    assert os.listdir(tmp_path) == ["model.pte"]


def test_replacing_refuses_to_replace_what_is_not_a_regular_file(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(WriteFailed, match="not a regular file"), replacing(pipe):
        pytest.fail("replacing let a named pipe be replaced")
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    assert os.listdir(tmp_path) == ["pipe"]


def test_replacing_gives_the_new_file_the_old_files_permissions(tmp_path: Path) -> None:
    path = tmp_path / "model.pte"
    path.write_bytes(OLD)
    path.chmod(0o640)
    write_bytes(path, b"new")
    assert path.stat().st_mode & 0o777 == 0o640


def test_replacing_writes_through_a_symlink_instead_of_replacing_it(tmp_path: Path) -> None:
    real = tmp_path / "real.pte"
    real.write_bytes(OLD)
    link = tmp_path / "link.pte"
    link.symlink_to(real)
    write_bytes(link, b"new")
    assert link.is_symlink() and real.read_bytes() == b"new"


def test_run_output_replaced_whole_so_a_mapped_old_file_survives(tmp_path: Path) -> None:
    pte = tmp_path / "ema.pte"
    pte.write_bytes(OLD)
    mapping, inode = _mapped(pte)
    result = CliRunner().invoke(main, ["run", "ema", "--backend", "none", "--steps", "2", "--output", str(pte)])
    assert result.exit_code == 0, result.output
    assert pte.read_bytes()[4:8] == b"ET12" and pte.stat().st_ino != inode
    assert mapping[:] == OLD
    assert os.listdir(tmp_path) == ["ema.pte"]
    mapping.close()


def test_run_output_written_atomically_old_file_intact_on_failure(tmp_path: Path) -> None:
    """The write of the .pte fails half way (a file size limit, as a full disk or a quota
    would): the old file is as it was, no temporary file is left, one line says why."""
    pte = tmp_path / "decoder.pte"
    pte.write_bytes(OLD)
    # Larger than the files exir writes while lowering (its ~19 KiB schema), smaller than the
    # decoder's ~72 KiB program: only the .pte hits the limit.
    limit = 48 << 10

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    script = Path(sys.executable).with_name("writeback")
    run = ["run", "decoder-caller-cache", "--backend", "none", "--steps", "1", "--no-check", "--output", str(pte)]
    done = subprocess.run(
        [str(script), *run],
        capture_output=True,
        text=True,
        timeout=900,
        preexec_fn=limit_file_size,  # Python ignores SIGXFSZ: the write fails with EFBIG instead
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert pte.read_bytes() == OLD, done.stderr
    assert os.listdir(tmp_path) == ["decoder.pte"]
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"Error: cannot write {pte}: File too large; it is left as it was" in done.stderr
    assert "Traceback" not in done.stderr
