"""What ``writeback generate`` checks before and around ExecuTorch's LLM runner.

Before the runner starts: the tokenizer is a regular file of a sane size (a JSON object
when it is ``*.json``, its token ids inside the program's vocabulary), the ``.pte`` is a
regular file whose runner metadata the stock runtime reads, and ``--max-new-tokens`` fits
the program's cache. Around the runner: its log (written by C++ to the process's stderr)
is kept, so that when it refuses a program, a tokenizer or a prompt (one longer than the
cache, say) the message gives the runner's own reason instead of "Generation failed".
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_TOKENIZER_BYTES",
    "ProgramLimits",
    "RunnerLog",
    "program_limits",
    "runner_log",
    "tokenizer_problem",
]

# The largest tokenizer any model ships is tens of MiB; past this a file is not a tokenizer.
MAX_TOKENIZER_BYTES = 512 << 20
# The runner's own log lines start with "[file.cpp:line] "; the rest is the message.
_LOG_PREFIX = re.compile(r"^(?:[EWID] [^\]]*\]|\[[\w./-]+:\d+\])\s*")
# Lines of the runner's log that say why it stopped (the rest is progress and settings).
_REASON = re.compile(
    r"fail|error|invalid|exceed|too (?:small|large|long)|not |couldn't|cannot|mismatch|>=|out of", re.IGNORECASE
)
# Lines the runner logs on every machine without an ARM CPU id: never a reason.
_NOISE = re.compile(r"midr|cpuinfo|CPU info", re.I)
# At most this many of the runner's lines go into a message.
_REASON_LINES = 4


def _regular_size(path: Path, what: str) -> tuple[int | None, str | None]:
    try:
        info = os.stat(path)
    except OSError as error:
        return None, f"{what} {path} cannot be read: {error.strerror or error}"
    if not stat.S_ISREG(info.st_mode):
        return None, f"{what} {path} is not a regular file (a device, a pipe or a directory); give the file itself"
    return info.st_size, None


def tokenizer_problem(path: Path, vocab_size: int | None) -> str | None:
    """Why ``path`` cannot be the tokenizer of a program with ``vocab_size`` tokens, or ``None``.

    Checked before anything reads it whole: a regular file, not empty, at most
    :data:`MAX_TOKENIZER_BYTES`; a ``*.json`` file must be a JSON object whose token ids
    (``model.vocab`` and ``added_tokens``) are all below ``vocab_size``.
    """
    size, problem = _regular_size(path, "--tokenizer")
    if problem is not None or size is None:
        return problem
    if size == 0:
        return f"--tokenizer {path} is empty"
    if size > MAX_TOKENIZER_BYTES:
        return f"--tokenizer {path} holds {size} bytes, more than the {MAX_TOKENIZER_BYTES} any tokenizer needs"
    if path.suffix != ".json":
        return None  # tokenizer.model (SentencePiece) and tiktoken files: the runner reads them
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:
        return f"--tokenizer {path} is not valid JSON ({type(error).__name__}: {error}); give a tokenizer.json"
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return f"--tokenizer {path} is JSON but not a tokenizer.json (no 'model' object)"
    highest = _highest_id(data)
    if vocab_size is not None and highest is not None and highest >= vocab_size:
        return (
            f"--tokenizer {path} has token ids up to {highest}, but the program's vocabulary holds {vocab_size} "
            "(get_vocab_size): its ids past the vocabulary have no logits; give the tokenizer the model was "
            "exported with"
        )
    return None


def _highest_id(data: dict[str, Any]) -> int | None:
    ids: list[int] = []
    vocab = data["model"].get("vocab")
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: a list of [piece, score]
        ids.append(len(vocab) - 1)
    added = data.get("added_tokens")
    if isinstance(added, list):
        ids += [t["id"] for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)]
    return max(ids, default=None)


@dataclass
class RunnerLog:
    """What the runner wrote to stderr while it was captured."""

    text: str = ""

    def reason(self) -> str:
        """The runner's lines that say why it stopped, their ``[file:line]`` prefixes dropped."""
        lines = [_LOG_PREFIX.sub("", line).strip() for line in self.text.splitlines()]
        reasons = [line for line in lines if line and _REASON.search(line) and not _NOISE.search(line)]
        return "; ".join(reasons[-_REASON_LINES:]) or "it logged no reason"


@contextmanager
def runner_log(replay: bool = True) -> Iterator[RunnerLog]:
    """Capture the process's stderr (file descriptor 2, where ExecuTorch's C++ logs) for the
    block into a :class:`RunnerLog`; written back to stderr afterwards when ``replay``."""
    log = RunnerLog()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            log.text = capture.read().decode("utf-8", "replace")
            if replay and log.text:
                sys.stderr.write(log.text)
                sys.stderr.flush()


@dataclass(frozen=True)
class ProgramLimits:
    """The runner metadata of a ``.pte`` that bounds a generation."""

    max_context_len: int
    vocab_size: int | None


def program_limits(pte: Path) -> tuple[ProgramLimits | None, str | None]:
    """``pte``'s cache length and vocabulary, read as the stock runtime reads them; or why not
    (not a regular file, or the runtime's own reason for refusing it)."""
    _, problem = _regular_size(pte, "PTE")
    if problem is not None:
        return None, problem
    from executorch.runtime import Runtime

    values: dict[str, int | None] = {}
    with runner_log(replay=False) as log:
        try:
            program = Runtime.get().load_program(pte)
            for name in ("get_max_context_len", "get_vocab_size"):
                if name in program.method_names:
                    out = program.load_method(name).execute([])
                    values[name] = int(out[0]) if out and isinstance(out[0], int) else None
        except (RuntimeError, ValueError) as error:
            failure: Exception | None = error
        else:
            failure = None
    if failure is not None:
        return None, f"ExecuTorch's runtime cannot load {pte}: {log.reason()} ({failure})"
    context = values.get("get_max_context_len")
    if context is None or context < 1:
        return None, (
            f"{pte} carries no get_max_context_len >= 1, which ExecuTorch's LLM runner needs; write it with "
            "`writeback export`"
        )
    return ProgramLimits(context, values.get("get_vocab_size")), None
