"""Upstream noise writeback silences, each named by message and category (or logger).

Two kinds, both measured on the supported versions while lowering the built-in
models:

- :data:`KNOWN_WARNINGS`, Python warnings that torch.export and exir raise on
  every lowering and that no user can act on. :func:`known_warnings_ignored`
  silences exactly these around a lowering; any other warning still shows.
- :data:`NOISE`, log lines of dependencies at import. :func:`quiet_upstream_noise`
  filters exactly these; the CLI installs it (a library must not change its
  host's logging).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import IO

__all__ = [
    "KNOWN_WARNINGS",
    "NATIVE_NOISE",
    "NOISE",
    "NativeLog",
    "known_warnings_ignored",
    "native_stderr_captured",
    "native_stderr_filtered",
    "quiet_upstream_noise",
]

# (message regex, category): what raises it and why it is harmless.
KNOWN_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # torch.export traces with autograd anomaly mode switched on internally.
    ("Anomaly Detection has been enabled", UserWarning),
    # torch's pytree, deep-copied by exir: an internal deprecation inside torch.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # exir's emitter on a mutated buffer: its initial value is serialized as
    # shape and dtype only; writeback's runtime and stock both zero-fill it.
    ("Mutation on a buffer in the model is detected", UserWarning),
    # importlib.resources legacy API, used by executorch's edge dialect and serializer.
    ("(read_text|open_text|read_binary|open_binary) is deprecated", DeprecationWarning),
    # torchao's and torch.jit's import-time deprecations, reached through executorch.
    ("Deprecation: TorchAODType is deprecated", UserWarning),
    (r"`torch\.jit\.script_method` is deprecated", DeprecationWarning),
    ("invalid escape sequence", DeprecationWarning),
    ("invalid escape sequence", SyntaxWarning),
    # strict export (dynamo) of a transformers model: transformers sets and resets a module-level
    # output collector inside forward, which dynamo replays (the hf- models of writeback-decoders).
    ("While compiling, we found certain side effects happened in the model.forward", UserWarning),
    # ExecuTorch's custom KV-cache ops call torch._check_is_size, which torch deprecates.
    ("_check_is_size will be removed", FutureWarning),
)


@contextlib.contextmanager
def known_warnings_ignored() -> Iterator[None]:
    """Silence :data:`KNOWN_WARNINGS` inside the block; every other warning passes."""
    with warnings.catch_warnings():
        for message, category in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


# (logger name, pattern its message matches): why each is harmless.
NOISE: tuple[tuple[str, re.Pattern[str]], ...] = (
    # torchao tries to load its CUDA-only extensions on import and logs each failure
    # on a CPU build; nothing writeback or executorch uses needs them.
    ("torchao", re.compile(r"Failed to load .*_C_(mxfp8|cutlass)\w*\..*Could not load this library")),
    # torchao registers an Enum with torch's pytree at import; torch 2.13 logs that
    # this is deprecated. Nothing to act on for a user of writeback.
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported by torch\.compile")),
)


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.search(record.getMessage()) is None


_installed = False


def quiet_upstream_noise() -> None:
    """Attach one filter per :data:`NOISE` entry to its logger (once per process)."""
    global _installed
    if _installed:
        return
    for name, pattern in NOISE:
        logging.getLogger(name).addFilter(_Drop(pattern))
    _installed = True


# Lines the C++ runtime libraries print on stderr, below Python: the threadpool of stock
# ``executorch.runtime`` (its own static copy of the runtime, whose log sink writeback's
# runtime cannot replace) logs five lines about /sys CPU files the first time a kernel
# runs in parallel, in either of its two formats; and when both runtimes are loaded in one
# process, the second to register its platform layer says so (harmless: both print).
NATIVE_NOISE = re.compile(
    r"^(\[cpuinfo_utils\.cpp:\d+\]|[DI] [\d:.]+ executorch:cpuinfo_utils\.cpp:\d+\]) "
    r"|^\[platform\.cpp:\d+\] register_pal\(\) called multiple times"
)


class NativeLog:
    """What anything in the process wrote to file descriptor 2 inside
    :func:`native_stderr_captured`, readable while the block runs."""

    def __init__(self, capture: IO[bytes]) -> None:
        self._capture = capture

    def mark(self) -> int:
        """A position to read :meth:`since` from."""
        sys.stderr.flush()
        return os.fstat(self._capture.fileno()).st_size

    def since(self, mark: int) -> list[str]:
        """The lines written since ``mark``."""
        sys.stderr.flush()
        data = os.pread(self._capture.fileno(), max(0, self.mark() - mark), mark)
        return data.decode(errors="replace").splitlines()


@contextlib.contextmanager
def native_stderr_captured(pattern: re.Pattern[str] = NATIVE_NOISE) -> Iterator[NativeLog]:
    """Inside the block, what anything in this process writes to file descriptor 2 (C++
    libraries included) goes to a temporary file the yielded :class:`NativeLog` reads; at the
    end every line not matching ``pattern`` is written to stderr, in order. Errors are
    delayed to the end of the block, never dropped. For work whose native libraries' log
    lines cannot be stopped where they are made (a fuzz worker, a benchmark's stock runtime).
    """
    sys.stderr.flush()
    saved, python_stderr = os.dup(2), sys.stderr
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        # Native code may also write through Python's sys.stderr (the stock runtime's pybind
        # module redirects its C++ log there), which a host such as pytest may have replaced.
        sys.stderr = open(os.dup(2), "w", buffering=1, errors="replace")
        try:
            yield NativeLog(capture)
        finally:
            sys.stderr.close()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [
                line for line in capture.read().decode(errors="replace").splitlines(True) if not pattern.match(line)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextlib.contextmanager
def native_stderr_filtered(pattern: re.Pattern[str] = NATIVE_NOISE) -> Iterator[None]:
    """:func:`native_stderr_captured` for a block that does not read the log."""
    with native_stderr_captured(pattern):
        yield
