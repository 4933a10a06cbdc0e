"""Put llama.cpp's GGUF files of a model folder beside writeback's `.pte` files of it, measured alike.

    uv run python docs/llamacpp_compare.py FOLDER --convert PATH/convert_hf_to_gguf.py \\
        --pte "writeback 8da4w=model.pte" [--types q4_0,q8_0] [--quantize-tool PATH/llama-quantize]

What it does: converts FOLDER (a Hugging Face folder, the one `writeback export` read) to an f32
GGUF with llama.cpp's own converter, quantizes that file to each of --types (q4_0: llama.cpp's
default, which keeps a tied embedding/LM head in q8_0 when the hidden size is no multiple of 256;
`q4_0-pure` quantizes it to q4_0 too, as writeback's 8da4w LM head is; q8_0) with llama.cpp's
quantizer (`llama-quantize` where --quantize-tool is given, else the same library function through
llama-cpp-python), then runs every contender (each GGUF through llama-cpp-python, each `--pte`
through ExecuTorch's `TextLLMRunner`) in a process of its own, in interleaved rounds with the
contenders' order rotated each round. Each process imports its runtime first, then measures: the
time from just before loading to the first logits of the prompt, the resident memory that loading
and prefill added by then, the peak through the generation (minus what the process held before
loading), the file's size, and prefill and decode tokens/s from greedy generation of the same
prompt text. Medians; ratios against the first row (or --baseline).

A folder whose tokenizer llama.cpp's converter does not recognise (it hashes how the tokenizer
splits a test text, and refuses an unknown hash: a test folder's tiny trained tokenizer, say) needs
`--pre-tokenizer NAME`: the converter then writes NAME (one of llama.cpp's pre-tokenizer names,
`gpt-2` for a byte-level BPE with GPT-2's split rule) where it would have refused.

Installing llama.cpp for it (not a dependency of writeback; keep it out of the project's lock file):
  - the Python binding, built from source with the CPU's AMX code off (a native build segfaults on
    quantized models in some virtual machines), into the environment that runs this script:
        CMAKE_ARGS="-DGGML_NATIVE=OFF" uv pip install --no-binary llama-cpp-python llama-cpp-python
  - llama.cpp's converter, of the llama.cpp that binding vendors (its source distribution carries it
    under vendor/llama.cpp) or of a checkout of the same date: pass `--convert
    PATH/convert_hf_to_gguf.py`; it imports the `gguf` package beside it (gguf-py), so the two match.
    Optionally build `llama-quantize` there (`cmake -B build -DGGML_NATIVE=OFF && cmake --build
    build --target llama-quantize`) and pass `--quantize-tool build/bin/llama-quantize`.
Without them the script exits with status 2 and says what is missing.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
BASE_TEXT = "the quick brown fox jumps over the lazy dog and the state it mutates is written once in place "
# llama-quantize's type names for each --types entry; "-pure" quantizes the embedding/output as the rest.
QUANTIZED = {"q4_0": ("Q4_0", False), "q4_0-pure": ("Q4_0", True), "q8_0": ("Q8_0", False)}
# Runs llama.cpp's converter (argv[1]) with its arguments (argv[3:]), writing the pre-tokenizer name
# argv[2] where the converter would refuse a tokenizer it does not recognise.
_CONVERT_WITH_PRE_TOKENIZER = """
import runpy, sys
from pathlib import Path
convert, name = sys.argv[1], sys.argv[2]
sys.argv = [convert, *sys.argv[3:]]
sys.path[:0] = [str(Path(convert).parent), str(Path(convert).parent / "gguf-py")]
from conversion import base
recognise = base.TextModel.get_vocab_base_pre
def recognised_or_named(self, tokenizer):
    try:
        return recognise(self, tokenizer)
    except NotImplementedError:
        print(f"llamacpp_compare: tokenizer not recognised; writing pre-tokenizer {name!r}", file=sys.stderr)
        return name
base.TextModel.get_vocab_base_pre = recognised_or_named
runpy.run_path(convert, run_name="__main__")
"""


@dataclass
class Row:
    name: str
    path: Path
    kind: str  # "gguf" or "pte"
    figures: list[dict[str, float]] = field(default_factory=list)
    error: str | None = None

    def median(self, key: str) -> float:
        values = [f[key] for f in self.figures]
        return float(statistics.median(values)) if values else float("nan")


def _missing(convert: Path | None, quantize_tool: Path | None, types: list[str]) -> list[str]:
    missing = []
    if importlib.util.find_spec("llama_cpp") is None:
        missing.append('llama-cpp-python (CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python)')
    if convert is None or not convert.is_file():
        missing.append("llama.cpp's convert_hf_to_gguf.py (--convert PATH; from a llama.cpp checkout)")
    if quantize_tool is not None and not quantize_tool.is_file():
        missing.append(f"llama.cpp's llama-quantize at {quantize_tool} (--quantize-tool)")
    return missing


def _quantize(source: Path, out: Path, name: str, quantize_tool: Path | None) -> None:
    """llama.cpp's quantizer: `llama-quantize` where given, else the same library call through the binding."""
    kind, pure = QUANTIZED[name]
    if quantize_tool is not None:
        subprocess.run([str(quantize_tool), *(["--pure"] if pure else []), str(source), str(out), kind], check=True)
        return
    llama_cpp: Any = importlib.import_module("llama_cpp")  # optional: not a dependency of writeback
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.pure = pure
    failed = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if failed:
        raise RuntimeError(f"llama.cpp's llama_model_quantize({source.name} -> {out.name}, {kind}) returned {failed}")


def _convert(
    folder: Path, convert: Path, pre_tokenizer: str | None, quantize_tool: Path | None, types: list[str], work: Path
) -> list[Row]:
    """The GGUF rows, converted into ``work``; files already there (from a ``--keep`` folder) are reused."""
    rows = []
    f32 = work / "model-f32.gguf"
    arguments = [str(folder), "--outtype", "f32", "--outfile", str(f32)]
    if not f32.is_file():
        launcher = [sys.executable, str(convert)]
        if pre_tokenizer is not None:
            launcher = [sys.executable, "-c", _CONVERT_WITH_PRE_TOKENIZER, str(convert), pre_tokenizer]
        subprocess.run([*launcher, *arguments], check=True)
    for name in types:
        out = f32 if name == "f32" else work / f"model-{name}.gguf"
        if not out.is_file():
            _quantize(f32, out, name, quantize_tool)
        rows.append(Row(f"llama.cpp {name}", out, "gguf"))
    return rows


def _prompt(folder: Path, tokens: int) -> str:
    from tokenizers import Tokenizer

    reader = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = reader.encode(BASE_TEXT * (tokens // 4 + 8)).ids[:tokens]
    text: str = reader.decode(ids)
    return text


def _gguf_child(request: dict[str, Any]) -> dict[str, float]:
    """One llama.cpp generation in this process (a fresh one): load, prefill, greedy decode. The
    binding is imported before the baseline, as the `.pte` child imports ExecuTorch's runtime."""
    import numpy as np
    from writeback_bench.resident_memory import read_resident, reset_peak

    llama_cpp: Any = importlib.import_module("llama_cpp")  # optional: not a dependency of writeback
    threads = int(request["threads"])
    new_tokens = int(request["new_tokens"])
    reset_peak()
    before = read_resident()
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(request["path"]), n_ctx=1024, n_threads=threads, n_batch=1024, verbose=False)
    loaded = time.perf_counter()
    vocab = llm.n_vocab()

    def next_token() -> int:
        # The last evaluated position's logits, read in place (the binding keeps no copy of them
        # unless every position's logits are asked for).
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        return int(row.argmax())

    tokens = llm.tokenize(str(request["prompt"]).encode(), add_bos=True)
    llm.eval(tokens)
    token = next_token()
    first = time.perf_counter()
    at_first = read_resident()
    for _ in range(new_tokens):
        llm.eval([token])
        token = next_token()
    end = time.perf_counter()
    peak = read_resident().peak
    return {
        "first_token_s": first - start,
        "load_s": loaded - start,
        "resident_added": at_first.total - before.total,
        "anon_added": at_first.anon - before.anon,
        "file_added": at_first.file - before.file,
        "peak_added": max(peak, at_first.total) - before.total,
        "prefill_tps": len(tokens) / (first - loaded),
        "decode_tps": new_tokens / (end - first),
        "prompt_tokens": len(tokens),
    }


def _measure(row: Row, folder: Path, prompt: str, new_tokens: int, threads: int) -> None:
    if row.kind == "pte":
        from dataclasses import asdict

        from writeback_bench.resident_memory import measure_in_child

        try:
            figures = asdict(measure_in_child(row.path, folder / "tokenizer.json", prompt, new_tokens, threads))
        except RuntimeError as error:
            row.error = str(error)
            return
        row.figures.append({k: float(v) for k, v in figures.items() if k != "text"})
        return
    with tempfile.TemporaryDirectory(prefix="llamacpp-compare-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(
            json.dumps({"path": str(row.path), "prompt": prompt, "new_tokens": new_tokens, "threads": threads})
        )
        done = subprocess.run([sys.executable, __file__, "--child", str(request)], capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            row.error = lines[-1] if lines else f"exit code {done.returncode}"
            return
        row.figures.append(json.loads(done.stdout.strip().splitlines()[-1]))


def _table(rows: list[Row], baseline: str | None) -> None:
    live = [r for r in rows if r.error is None and r.figures]
    base = next((r for r in live if r.name == baseline), live[0] if live else None)
    keys = ["first_token_s", "resident_added", "peak_added", "prefill_tps", "decode_tps"]
    print(
        f"{'contender':<28} {'file MiB':>8} {'load s':>6} {'resident MiB':>12} {'peak MiB':>8} "
        f"{'prefill tok/s':>13} {'decode tok/s':>12}   ratios to {base.name if base else '-'}: load, resident, "
        "peak, prefill, decode"
    )
    for row in rows:
        if row.error is not None or not row.figures:
            print(f"{row.name:<28} failed: {row.error}")
            continue
        ratios = " ".join(f"{row.median(k) / base.median(k):.2f}" if base else "nan" for k in keys)
        print(
            f"{row.name:<28} {row.path.stat().st_size / MIB:>8.1f} {row.median('first_token_s'):>6.2f} "
            f"{row.median('resident_added') / MIB:>12.1f} {row.median('peak_added') / MIB:>8.1f} "
            f"{row.median('prefill_tps'):>13.1f} {row.median('decode_tps'):>12.1f}   {ratios}"
        )


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_gguf_child(json.loads(Path(sys.argv[2]).read_text()))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the Hugging Face folder writeback exported")
    parser.add_argument("--convert", type=Path, default=None, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument(
        "--quantize-tool", type=Path, default=None, help="llama.cpp's llama-quantize (default: the binding's quantizer)"
    )
    parser.add_argument(
        "--pre-tokenizer", default=None, help="llama.cpp pre-tokenizer name for a tokenizer its converter does not know"
    )
    parser.add_argument("--types", default="q4_0,q8_0", help=f"GGUF types: f32, {', '.join(QUANTIZED)}")
    parser.add_argument("--pte", action="append", default=[], metavar="NAME=PATH", help="a .pte contender")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", default=None, help="the row ratios are against (default: the first)")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's figures here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the GGUF files here (reused)")
    args = parser.parse_args()
    types = [t for t in args.types.split(",") if t]
    unknown = [t for t in types if t != "f32" and t not in QUANTIZED]
    missing = _missing(args.convert, args.quantize_tool, types)
    if unknown or missing or not (args.folder / "tokenizer.json").is_file():
        problems = [*(f"unknown GGUF type {t!r}" for t in unknown), *(f"{m} is not installed" for m in missing)]
        if not (args.folder / "tokenizer.json").is_file():
            problems.append(f"{args.folder} has no tokenizer.json")
        print(
            "llamacpp_compare: cannot run: " + "; ".join(problems) + ". This script puts llama.cpp's GGUF files "
            "of the folder beside writeback's .pte files; llama.cpp is not a dependency of writeback, so install "
            "it as this script's docstring says (build with -DGGML_NATIVE=OFF) and pass --convert (and, if you "
            "built it, --quantize-tool). Nothing was written.",
            file=sys.stderr,
        )
        return 2
    ptes = []
    for item in args.pte:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            print(f"llamacpp_compare: --pte {item!r} is not NAME=PATH of an existing file.", file=sys.stderr)
            return 2
        ptes.append(Row(name, Path(path), "pte"))
    work = args.keep or Path(tempfile.mkdtemp(prefix="llamacpp-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = [*_convert(args.folder, args.convert, args.pre_tokenizer, args.quantize_tool, types, work), *ptes]
        prompt = _prompt(args.folder, args.prompt_tokens)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        for round_ in range(args.rounds):
            order = rows[round_ % len(rows) :] + rows[: round_ % len(rows)]
            for row in order:
                if row.error is None:
                    print(f"round {round_ + 1}: {row.name}", file=sys.stderr)
                    _measure(row, args.folder, prompt, args.new_tokens, args.threads)
        print(
            f"{args.folder}: prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy; "
            f"{args.rounds} interleaved rounds, each run in a process of its own; {args.threads} thread(s); medians"
        )
        _table(rows, args.baseline)
        if args.json is not None:
            rounds = {row.name: {"file_bytes": row.path.stat().st_size, "rounds": row.figures} for row in rows}
            args.json.write_text(json.dumps(rounds, indent=1))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
