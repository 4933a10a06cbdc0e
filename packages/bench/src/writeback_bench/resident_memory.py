"""What loading a program adds to a process: resident memory (anonymous and file-backed, read
from ``/proc/self/status``), its peak, and the time to the first logits, measured in a process
of its own so that one contender's pages never count against another's.

``measure_generation`` runs in the child: it reads the baseline after the runtime's own imports,
loads the ``.pte`` in ExecuTorch's ``TextLLMRunner`` (which maps the file; XNNPACK packs its
weights at load and the runtime then unmaps the file's pages it packed from), generates, and
reads memory again at the first token (load and prefill done) and its peak at the end.
``measure_in_child`` starts that child and returns its figures. Linux only (``/proc``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["LoadFigures", "Resident", "measure_generation", "measure_in_child", "read_resident", "reset_peak"]

_FIELDS = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem", "VmHWM:": "peak"}


@dataclass(frozen=True)
class Resident:
    """This process's resident memory, bytes: anonymous, file-backed, and the peak of the whole
    resident set since the last ``reset_peak`` (or the process's start)."""

    anon: int
    file: int
    peak: int

    @property
    def total(self) -> int:
        return self.anon + self.file


def read_resident() -> Resident:
    """This process's resident memory now (``/proc/self/status``; shared memory counts as file)."""
    values = {"anon": 0, "file": 0, "shmem": 0, "peak": 0}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            parts = line.split()
            if parts and parts[0] in _FIELDS:
                values[_FIELDS[parts[0]]] = int(parts[1]) * 1024
    return Resident(values["anon"], values["file"] + values["shmem"], values["peak"])


def reset_peak() -> bool:
    """Set this process's peak resident figure to its resident set now (Linux's ``clear_refs``
    5), so that a later peak counts only what came after. False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class LoadFigures:
    """One generation in a process of its own. Memory in bytes, added to the process by loading
    and running (minus what it held just before loading); times in seconds from just before
    loading; speeds in tokens/s from the runner's own statistics."""

    first_token_s: float  # before load to the first token (program loaded, prompt prefilled, first logits read)
    load_s: float  # the runner's own load (program, methods, delegate initialization)
    resident_added: int  # at the first token
    anon_added: int
    file_added: int
    peak_added: int  # the highest resident set from just before loading to the end of the generation
    prefill_tps: float
    decode_tps: float
    prompt_tokens: int
    text: str


@contextmanager
def _stdout_silenced() -> Iterator[None]:
    """The C++ runner prints every piece to file descriptor 1: keep it off the caller's output."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def measure_generation(pte: Path, tokenizer: Path, prompt: str, new_tokens: int, threads: int = 1) -> LoadFigures:
    """Load ``pte`` in ``TextLLMRunner`` and generate greedily in this process (see the module
    docstring). Call it in a fresh process: the baseline is what the process holds before it."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    from writeback_core.llm_runner import data_file_beside, load_runner_kernels

    load_runner_kernels()
    data = data_file_beside(pte)
    try:
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(threads)
    except (ImportError, AttributeError):
        pass
    config = GenerationConfig(echo=False, max_new_tokens=new_tokens, temperature=0.0)
    pieces: list[str] = []
    at_first: list[tuple[float, Resident]] = []

    def on_token(piece: str) -> None:
        if not at_first:
            at_first.append((time.perf_counter(), read_resident()))
        pieces.append(piece)

    stats: list[object] = []
    reset_peak()
    before = read_resident()
    start = time.perf_counter()
    runner = TextLLMRunner(str(pte), str(tokenizer), None if data is None else str(data))
    with _stdout_silenced():
        runner.generate(prompt, config, token_callback=on_token, stats_callback=stats.append)
    end = read_resident()
    if not at_first or not stats:
        raise RuntimeError(f"the runner generated no token from {pte} (new_tokens={new_tokens})")
    first_time, first = at_first[0]
    s: Any = stats[-1]  # the runner's Stats: executorch's bindings carry no type stubs
    prefill_ms = max(s.prompt_eval_end_ms - s.inference_start_ms, 1)
    decode_ms = max(s.inference_end_ms - s.prompt_eval_end_ms, 1)
    return LoadFigures(
        first_token_s=first_time - start,
        load_s=(s.model_load_end_ms - s.model_load_start_ms) / 1e3,
        resident_added=first.total - before.total,
        anon_added=first.anon - before.anon,
        file_added=first.file - before.file,
        peak_added=max(end.peak, first.total) - before.total,
        prefill_tps=s.num_prompt_tokens / prefill_ms * 1e3,
        decode_tps=s.num_generated_tokens / decode_ms * 1e3,
        prompt_tokens=int(s.num_prompt_tokens),
        text="".join(pieces),
    )


def measure_in_child(
    pte: Path, tokenizer: Path, prompt: str, new_tokens: int, threads: int = 1, timeout: float | None = None
) -> LoadFigures:
    """``measure_generation`` in a new Python process; raises ``RuntimeError`` with the child's last
    error line when it fails."""
    with tempfile.TemporaryDirectory(prefix="writeback-resident-") as folder:
        request = Path(folder) / "request.json"
        answer = Path(folder) / "answer.json"
        request.write_text(
            json.dumps(
                {
                    "pte": str(pte),
                    "tokenizer": str(tokenizer),
                    "prompt": prompt,
                    "new_tokens": new_tokens,
                    "threads": threads,
                    "answer": str(answer),
                }
            )
        )
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(
            [sys.executable, "-m", __name__, str(request)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environment,
            check=False,
        )
        if done.returncode != 0 or not answer.is_file():
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit code {done.returncode}"
            raise RuntimeError(f"measuring {pte.name} in a child process failed: {last}")
        return LoadFigures(**json.loads(answer.read_text()))


def _main(request_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    figures = measure_generation(
        Path(request["pte"]), Path(request["tokenizer"]), request["prompt"], request["new_tokens"], request["threads"]
    )
    Path(request["answer"]).write_text(json.dumps(asdict(figures)))


if __name__ == "__main__":
    _main(sys.argv[1])
