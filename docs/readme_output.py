"""Write what README.md quotes of a command's output from the current code, or check it.

Every fenced block of README.md that quotes what a command prints has a marker on the
line before its fence, naming what to run::

    <!-- output: writeback run --steps 3 --output model.pte -->

A marker holds one or more parts separated by `` ; ``, run in order in one fresh
temporary folder, the commands' current directory (so an ``--output`` name is relative
and no machine path reaches the README):

- ``writeback ARGS``: the CLI through click's ``CliRunner`` in this process, or in a fresh
  process for the subcommands in :data:`FRESH_PROCESS`;
- ``python PATH ARGS``: a script of this repository, in a fresh process;
- a name in :data:`SETUPS`: a file or folder a reader would make (a model file, a model
  folder) written into the folder; it prints nothing;
- a command may end in ``2>/dev/null`` (its stdout alone) and then in ``| head -N`` (its
  first N lines).

The block becomes, for each command, ``$ COMMAND`` and then what a terminal of
:data:`COLUMNS` columns shows (stdout and stderr as they come). Figures that timing or the
machine decide stay as measured in the block; :func:`masked` hides them when comparing.

Run from the repository's root::

    uv run python docs/readme_output.py            # rewrite every marked block
    uv run python docs/readme_output.py --check    # compare only; exit 1 on a difference
    uv run python docs/readme_output.py --fast     # skip the slow markers (see is_slow)
    uv run python docs/readme_output.py explain    # only markers whose text contains "explain"

``tests/test_readme_output.py`` runs the check for every marker.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# The terminal every command prints to.
COLUMNS = 120
# Subcommands run in a fresh process: ExecuTorch's LLM runner prints its statistics line
# from C++ straight to the process's stdout, which CliRunner cannot see; the benchmarks load
# ExecuTorch's stock runtime beside writeback's, and what their native libraries log then
# depends on what the process loaded before.
FRESH_PROCESS = frozenset({"generate", "bench", "bench-generate", "bench-scale"})
# Subcommands that take more than about 10 s at any size worth quoting (the test's slow tier).
SLOW = frozenset({"bench", "bench-generate", "bench-scale", "export", "generate", "fuzz"})

_MARKER = re.compile(r"^<!-- output: (?P<text>.+?) -->$")
_FENCE = "```"
_HEAD = re.compile(r"\s+\|\s+head\s+-(?P<lines>\d+)$")
_NO_STDERR = re.compile(r"\s+2>/dev/null$")
# Environment variables that would change what a command prints (plugins loaded, traces, logs).
_UNSET = (
    "WRITEBACK_LOAD_PLUGINS",
    "WRITEBACK_BLOCK_PLUGINS",
    "WRITEBACK_TRACE_PLUGINS",
    "WRITEBACK_TRACEBACK",
    "WRITEBACK_RUNTIME_LOG",
)


# --- what is run -------------------------------------------------------------------------


def _model_file(folder: Path) -> None:
    """``mymodel.py``: a model file whose factory raises while reading its configuration."""
    (folder / "mymodel.py").write_text(
        "import torch\n"
        "\n"
        "CONFIG = {'layers': 2}\n"
        "\n"
        "def _load_config():\n"
        "    return CONFIG['heads']\n"
        "\n"
        "def make():\n"
        "    heads = _load_config()\n"
        "    return torch.nn.Linear(heads, heads), (torch.ones(1, heads),)\n"
    )


# The text a tiny tokenizer is trained on, and the prompt the README's generation uses.
_TEXT = ["the quick brown fox jumps over the lazy dog", "state that a model mutates is written once in place"] * 20


def _tiny_llama(folder: Path) -> None:
    """``tiny-llama/``: a Hugging Face Llama folder with random weights (seed 0), 2 layers,
    64 positions, and a byte-level BPE tokenizer of 96 tokens trained on a few sentences,
    as tests/decoders make one."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    path = folder / "tiny-llama"
    path.mkdir()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_TEXT, trainers.BpeTrainer(vocab_size=96, special_tokens=["<s>", "</s>"]))
    tokenizer.save(str(path / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


# Files and folders a marker can ask for, by name; each prints nothing.
SETUPS: dict[str, Callable[[Path], None]] = {
    "mymodel.py": _model_file,
    "tiny-llama": _tiny_llama,
}


@dataclass(frozen=True)
class Part:
    """One part of a marker: a setup (``setup`` set) or a command (``argv`` set)."""

    text: str
    setup: Callable[[Path], None] | None = None
    argv: tuple[str, ...] = ()
    head: int | None = None
    stderr: bool = True

    @property
    def slow(self) -> bool:
        if self.setup is not None:
            return False
        return self.argv[0] == "python" or (len(self.argv) > 1 and self.argv[1] in SLOW)


def parts(text: str) -> list[Part]:
    """The parts of a marker's text.

    :raises ValueError: a part is neither a setup's name nor a ``writeback`` or ``python`` command.
    """
    found: list[Part] = []
    for piece in re.split(r"\s+;\s+", text.strip()):
        if piece in SETUPS:
            found.append(Part(piece, setup=SETUPS[piece]))
            continue
        head = _HEAD.search(piece)
        command = piece[: head.start()] if head else piece
        quiet = _NO_STDERR.search(command)
        argv = tuple(shlex.split(command[: quiet.start()] if quiet else command))
        if not argv or argv[0] not in ("writeback", "python"):
            raise ValueError(
                f"marker part {piece!r} is neither a setup ({', '.join(SETUPS)}) nor a writeback or python command"
            )
        found.append(Part(piece, argv=argv, head=int(head["lines"]) if head else None, stderr=quiet is None))
    return found


def is_slow(text: str) -> bool:
    """Whether a marker runs a command of the slow tier (:data:`SLOW`, or a script)."""
    return any(part.slow for part in parts(text))


def _environment() -> dict[str, str | None]:
    return {"COLUMNS": str(COLUMNS), "LINES": "50", "FORCE_COLOR": None, **dict.fromkeys(_UNSET)}


@contextlib.contextmanager
def _in_folder(folder: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _warnings_as_a_process_shows_them(stream: Callable[[], TextIO]) -> Iterator[None]:
    """Python's default warning filters, each warning printed to ``stream()`` (CliRunner's
    stderr), as a fresh ``writeback`` process would: not a test runner's filters."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")

        def show(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            stream().write(warnings.formatwarning(message, category, filename, lineno, line))

        warnings.showwarning = show
        yield


def _in_process(argv: Sequence[str], stderr: bool) -> str:
    from click.testing import CliRunner
    from writeback.cli import main

    runner = CliRunner(env=_environment())
    with _warnings_as_a_process_shows_them(lambda: sys.stderr):
        result = runner.invoke(main, list(argv), prog_name="writeback")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise RuntimeError(f"writeback {shlex.join(argv)} raised") from result.exception
    return result.output if stderr else result.stdout


def _fresh_process(argv: Sequence[str], stderr: bool) -> str:
    environment = {k: v for k, v in os.environ.items() if k not in _UNSET and k != "FORCE_COLOR"}
    environment |= {"COLUMNS": str(COLUMNS), "LINES": "50", "PYTHONUNBUFFERED": "1"}
    where = subprocess.STDOUT if stderr else subprocess.DEVNULL
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=where, text=True, env=environment, check=False)
    if "Traceback (most recent call last)" in done.stdout:
        raise RuntimeError(f"{shlex.join(argv)} crashed (exit {done.returncode}):\n{done.stdout}")
    return done.stdout


def _run(part: Part, folder: Path) -> list[str]:
    if part.argv[0] == "python":
        printed = _fresh_process([sys.executable, str(ROOT / part.argv[1]), *part.argv[2:]], part.stderr)
    elif part.argv[1] in FRESH_PROCESS:
        printed = _fresh_process([sys.executable, "-m", "writeback", *part.argv[1:]], part.stderr)
    else:
        printed = _in_process(part.argv[1:], part.stderr)
    for where in sorted({str(folder.resolve()), str(folder)}, key=len, reverse=True):
        printed = printed.replace(where + os.sep, "").replace(where, ".")
    printed = printed.replace(tempfile.gettempdir(), "<tmp>")
    lines = [line.rstrip() for line in printed.splitlines()]
    return lines[: part.head] if part.head is not None else lines


def produce(text: str) -> list[str]:
    """The lines of the block under the marker ``text``, printed by the current code."""
    block: list[str] = []
    with tempfile.TemporaryDirectory(prefix="readme-output-") as scratch:
        folder = Path(scratch)
        with _in_folder(folder):
            for part in parts(text):
                if part.setup is not None:
                    # Making it prints what a reader would not see (transformers' progress bars).
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        part.setup(folder)
                    continue
                block.append(f"$ {part.text}")
                block.extend(_run(part, folder))
    return block


# --- the README's blocks -------------------------------------------------------------------


@dataclass(frozen=True)
class Marker:
    """A marker of README.md and the block it heads: lines ``first`` to ``end`` (exclusive)."""

    text: str
    first: int
    end: int
    quoted: tuple[str, ...]


def markers(readme: str) -> list[Marker]:
    """Every marker of ``readme`` with its block.

    :raises ValueError: a marker is not directly followed by a fenced block.
    """
    lines = readme.splitlines()
    found: list[Marker] = []
    for index, line in enumerate(lines):
        match = _MARKER.match(line)
        if match is None:
            continue
        if index + 1 >= len(lines) or lines[index + 1] != _FENCE:
            raise ValueError(f"README.md line {index + 1}: the marker {line!r} is not followed by a ``` fence")
        end = next((i for i in range(index + 2, len(lines)) if lines[i] == _FENCE), None)
        if end is None:
            raise ValueError(f"README.md line {index + 1}: the block under {line!r} is never closed")
        found.append(Marker(match["text"], index + 2, end, tuple(lines[index + 2 : end])))
    return found


def rewrite(readme: str, marker: Marker, block: Sequence[str]) -> str:
    """``readme`` with ``marker``'s block replaced by ``block``."""
    lines = readme.splitlines()
    lines[marker.first : marker.end] = block
    return "\n".join(lines) + ("\n" if readme.endswith("\n") else "")


# --- comparing -----------------------------------------------------------------------------

_NUMBER = r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
# A rate over a time the runner rounds to 0 ms prints as inf.
_MEASURE = rf"(?:{_NUMBER}|inf|nan)"
# Units of what timing or the machine decides: times, rates, ratios of times, memory sizes of
# the machine (a program's or state's size in B/KiB/MiB is the code's, and is compared).
_MEASURED_UNIT = r"(?:ms|µs|us|s|GB|GiB|tokens/s|tok/s|x)"
MASKS: tuple[tuple[re.Pattern[str], str], ...] = (
    # 4.0 s, 1.506 ms, 12.3 µs, 3.4x, 0.08 GB, 1500.0 tokens/s
    (re.compile(rf"(?<![\w.]){_MEASURE}(?=\s?{_MEASURED_UNIT}(?!\w))"), "<n>"),
    # a row of figures in a plain table: bench-generate's "16000.0  15000.0  1.00  1.33"
    (re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?: +\d+(?:\.\d+)?){3,}(?![\w.])"), "<figures>"),
    # the memory --cache-mib may take: "so at most 2919 MiB"
    (re.compile(r"(?<=so at most )\d+(?= MiB)"), "<n>"),
    # bench's goals: "4.27 (met, goal >= 3)", "(MISSED, goal ...)"
    (re.compile(rf"{_NUMBER} \((?:met|MISSED), goal"), "<n> (<met?>, goal"),
    # the LLM runner's JSON statistics: times since the epoch, rates (a rate over 0 ms is left out)
    (re.compile(r"PyTorchObserver \{.*\}"), "PyTorchObserver {<statistics>}"),
    # rounding errors against eager ("7.15e-07"): the last bits follow the CPU's kernels
    (re.compile(r"(?<![\w.])\d\.\d+e[-+]\d+"), "<err>"),
    # dates
    (re.compile(r"\b\d{4}-\d{2}-\d{2}\b"), "<date>"),
    # a temporary path, were one printed
    (re.compile(r"<tmp>\S*"), "<tmp>"),
    # a masked time keeps no unit: the same step prints "1.2 ms" on one run and "950 µs" on the next
    (re.compile(r"<n>\s?(?:ms|µs|us|s)(?![\w/])"), "<n> <time>"),
)
# A column is measured when its header names a unit of time or rate ("latency ms").
_MEASURED_HEADER = re.compile(r"\b(?:ms|s|µs|GB|tok/s|tokens/s|latency)\b")
# Alignment follows the widths of measured figures; only the text between is compared.
_SPACES = re.compile(r" {2,}")
_RULES = re.compile(r"(─|━|═)\1+")


def _header_columns(lines: Sequence[str], start: int) -> tuple[set[int], int]:
    """The measured columns of a rich table whose header starts at ``lines[start]`` (``┃`` rows),
    and the index of the first line after the header."""
    cells: list[str] = []
    index = start
    while index < len(lines) and lines[index].lstrip().startswith("┃"):
        for column, cell in enumerate(lines[index].split("┃")):
            if column >= len(cells):
                cells.append("")
            cells[column] += " " + cell.strip()
        index += 1
    return {column for column, text in enumerate(cells) if _MEASURED_HEADER.search(text)}, index


def masked(lines: Sequence[str]) -> list[str]:
    """``lines`` with what timing or the machine decides replaced by placeholders, and runs of
    spaces and of table rules shortened to one (alignment follows the measured widths)."""
    out: list[str] = []
    measured: set[int] = set()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("┃"):
            measured, after = _header_columns(lines, index)
            out.extend(lines[index:after])
            index = after
            continue
        if measured and line.lstrip().startswith("│"):
            cells = line.split("│")
            line = "│".join(re.sub(_NUMBER, "<n>", c) if i in measured else c for i, c in enumerate(cells))
        elif line.lstrip().startswith("└"):
            measured = set()
        out.append(line)
        index += 1
    result = []
    for line in out:
        for pattern, placeholder in MASKS:
            line = pattern.sub(placeholder, line)
        result.append(_RULES.sub(r"\1", _SPACES.sub(" ", line)).strip())
    return result


def differences(quoted: Sequence[str], fresh: Sequence[str]) -> list[str]:
    """A unified diff of the quoted block against fresh output, after :func:`masked`; empty
    when they agree line by line."""
    return list(
        difflib.unified_diff(masked(quoted), masked(fresh), "README.md (masked)", "fresh output (masked)", lineterm="")
    )


# --- the command ---------------------------------------------------------------------------


def _chosen(found: Sequence[Marker], select: Sequence[str], fast: bool) -> list[Marker]:
    return [m for m in found if (not select or any(s in m.text for s in select)) and not (fast and is_slow(m.text))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("select", nargs="*", help="only markers whose text contains one of these")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a block differs")
    parser.add_argument("--fast", action="store_true", help="skip the markers of the slow tier")
    args = parser.parse_args(argv)
    readme = README.read_text()
    chosen = _chosen(markers(readme), args.select, args.fast)
    if not chosen:
        print("no marker chosen", file=sys.stderr)
        return 2
    failed = 0
    for marker in chosen:
        start = time.monotonic()
        block = produce(marker.text)
        took = f"{time.monotonic() - start:.1f} s"
        if args.check:
            diff = differences(marker.quoted, block)
            failed += bool(diff)
            print(f"{'differs' if diff else 'same'}: {marker.text} ({took})")
            for line in diff:
                print(f"    {line}")
            continue
        # Read again: the README may have been edited while the command ran.
        readme = README.read_text()
        now = [m for m in markers(readme) if m.text == marker.text]
        if not now:
            print(f"gone from README.md while it ran: {marker.text}", file=sys.stderr)
            failed += 1
            continue
        for same in reversed(now):  # last first: a rewritten block moves the lines after it
            readme = rewrite(readme, same, block)
        README.write_text(readme)
        print(f"wrote: {marker.text} ({took})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
