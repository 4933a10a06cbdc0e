"""The files the CLI writes appear whole or not at all.

Every file goes to a temporary file in the target's folder and is renamed onto
the target (``os.replace``) once complete, so a reader never sees a partial
file, a process that has the old file open or memory-mapped keeps reading the
old bytes (the rename leaves its inode alone; truncating it in place would
kill such a process with SIGBUS), and a failure or Ctrl-C at any point leaves
the old file as it was and no temporary file behind.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["WriteFailed", "replacing", "unwritable_reason", "write_bytes"]


class WriteFailed(OSError):
    """Writing a file failed (the disk filled, a quota, a vanished folder): the old file is
    left as it was and no temporary file remains. ``__cause__`` is the error itself."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(f"cannot write {path}: {error.strerror or error}; it is left as it was")
        self.path = path


def _target(path: Path) -> Path:
    # Write through a symlink, as an ordinary write would, instead of replacing the link.
    return Path(os.path.realpath(path))


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write; renamed onto ``path`` when the block ends.

    The folder is created if missing. The new file gets the old file's permissions (or the umask's defaults) and is
    flushed to disk before the rename. On any exception, ``KeyboardInterrupt``
    included, the temporary file is removed and ``path`` is left untouched.

    :raises WriteFailed: ``path`` is not a regular file (a device, a pipe), or an
        ``OSError`` while creating, writing or renaming the file.
    """
    target = _target(path)
    if target.exists() and not target.is_file():
        # A device or a pipe (``/dev/null``): renaming onto it would replace the node itself.
        raise WriteFailed(path, OSError(errno.EINVAL, "not a regular file, and only files are replaced"))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as error:
        raise WriteFailed(path, error) from error
    temporary = Path(name)
    try:
        os.close(fd)
        yield temporary
        os.chmod(temporary, _mode_for(target))
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError) and not isinstance(error, WriteFailed):
            raise WriteFailed(path, error) from error
        raise


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (see :func:`replacing`)."""
    with replacing(path) as temporary:
        temporary.write_bytes(data)


def unwritable_reason(path: Path) -> str | None:
    """Why :func:`replacing` could not write ``path``, or ``None`` when it can.

    Checks that ``path`` is not a directory or another non-regular file, and that a
    file can be created in its folder, or, when the folder does not exist yet, in
    the nearest folder above it that does (:func:`replacing` creates the rest). It
    tries by creating and removing a file: permission bits say nothing for root or
    on a read-only mount.
    """
    target = _target(path)
    if target.is_dir():
        return f"{path} is a directory; give the path of a file (inside it, say)"
    if target.exists() and not target.is_file():
        return f"{path} exists and is not a regular file; the new file is renamed into place, which would replace it"
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".probe")
    except OSError as error:
        return f"cannot create a file in {folder}: {error.strerror or error}"
    os.close(fd)
    os.unlink(probe)
    return None
