"""Put llama.cpp's GGUF files of a model folder beside writeback's `.pte` files of it, measured alike.

    uv run python docs/llamacpp_compare.py FOLDER --convert PATH/convert_hf_to_gguf.py \\
        --quantize-tool PATH/llama-quantize --pte "writeback 8da4w=model.pte" [--types q4_0,q8_0]

What it does: converts FOLDER (a Hugging Face folder, the one `writeback export` read) to GGUF with
llama.cpp's own converter (f32, and q8_0), quantizes the f32 file to q4_0 with `llama-quantize`
(llama.cpp's default keeps the embedding/output in q8_0; `q4_0-pure` quantizes them to q4_0 too, as
writeback's 8da4w LM head is), then runs every contender (each GGUF through llama-cpp-python, each
`--pte` through ExecuTorch's `TextLLMRunner`) in a process of its own, in interleaved rounds with the
contenders' order rotated each round: the time from just before loading to the first logits of the
prompt, the resident memory that loading and prefill added by then, the peak through the generation
(minus what the process held before loading), the file's size, and prefill and decode tokens/s from
greedy generation of the same prompt text. Medians; ratios against the first row (or --baseline).

Installing llama.cpp for it (not a dependency of writeback):
  - the Python binding, built from source with the CPU's AMX code off (a native build segfaults on
    quantized models in some virtual machines):
        CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install --no-binary llama-cpp-python llama-cpp-python
  - llama.cpp's converter and quantizer: clone llama.cpp, `pip install -r requirements.txt` there
    (`gguf`, `sentencepiece`, ...), build with `cmake -B build -DGGML_NATIVE=OFF && cmake --build
    build --target llama-quantize`; pass `--convert convert_hf_to_gguf.py` and `--quantize-tool
    build/bin/llama-quantize` from that checkout.
Without them the script exits with status 2 and says what is missing.
"""

from __future__ import annotations

import argparse
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

MIB = 1 << 20
BASE_TEXT = "the quick brown fox jumps over the lazy dog and the state it mutates is written once in place "
# llama-quantize's type names for each --types entry; "-pure" quantizes the embedding/output as the rest.
QUANTIZED = {"q4_0": ("Q4_0", False), "q4_0-pure": ("Q4_0", True), "q8_0": ("Q8_0", False)}


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
    if any(t.startswith("q4_0") for t in types) and (quantize_tool is None or not quantize_tool.is_file()):
        missing.append(
            "llama.cpp's llama-quantize (--quantize-tool PATH; cmake -DGGML_NATIVE=OFF, target llama-quantize)"
        )
    return missing


def _convert(folder: Path, convert: Path, quantize_tool: Path | None, types: list[str], work: Path) -> list[Row]:
    rows = []
    f32 = work / "model-f32.gguf"
    subprocess.run([sys.executable, str(convert), str(folder), "--outtype", "f32", "--outfile", str(f32)], check=True)
    for name in types:
        out = work / f"model-{name}.gguf"
        if name == "f32":
            out = f32
        elif name == "q8_0" and not quantize_tool:
            subprocess.run(
                [sys.executable, str(convert), str(folder), "--outtype", "q8_0", "--outfile", str(out)], check=True
            )
        else:
            kind, pure = QUANTIZED[name]
            assert quantize_tool is not None
            subprocess.run([str(quantize_tool), *(["--pure"] if pure else []), str(f32), str(out), kind], check=True)
        rows.append(Row(f"llama.cpp {name}", out, "gguf"))
    return rows


def _prompt(folder: Path, tokens: int) -> str:
    from tokenizers import Tokenizer

    reader = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = reader.encode(BASE_TEXT * (tokens // 4 + 8)).ids[:tokens]
    text: str = reader.decode(ids)
    return text


def _gguf_child(request: dict[str, object]) -> dict[str, float]:
    """One llama.cpp generation in this process (a fresh one): load, prefill, greedy decode."""
    from writeback_bench.resident_memory import read_resident, reset_peak

    threads = int(request["threads"])  # type: ignore[call-overload]
    new_tokens = int(request["new_tokens"])  # type: ignore[call-overload]
    reset_peak()
    before = read_resident()
    start = time.perf_counter()
    llama_cpp = importlib.import_module("llama_cpp")  # optional: not a dependency of writeback
    llm = llama_cpp.Llama(model_path=str(request["path"]), n_ctx=1024, n_threads=threads, n_batch=1024, verbose=False)
    loaded = time.perf_counter()
    tokens = llm.tokenize(str(request["prompt"]).encode(), add_bos=True)
    llm.eval(tokens)
    logits = llm.eval_logits[-1]
    first = time.perf_counter()
    at_first = read_resident()
    for _ in range(new_tokens):
        token = max(range(len(logits)), key=logits.__getitem__)
        llm.eval([token])
        logits = llm.eval_logits[-1]
    end = time.perf_counter()
    peak = read_resident().peak
    return {
        "first_token_s": first - start,
        "load_s": loaded - start,
        "resident_added": at_first.total - before.total,
        "peak_added": max(peak, at_first.total) - before.total,
        "prefill_tps": len(tokens) / (first - loaded),
        "decode_tps": new_tokens / (end - first),
    }


def _measure(row: Row, folder: Path, prompt: str, new_tokens: int, threads: int) -> None:
    if row.kind == "pte":
        from dataclasses import asdict

        from writeback_bench.resident_memory import measure_in_child

        figures = asdict(measure_in_child(row.path, folder / "tokenizer.json", prompt, new_tokens, threads))
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
    parser.add_argument("--quantize-tool", type=Path, default=None, help="llama.cpp's llama-quantize binary")
    parser.add_argument("--types", default="q4_0,q8_0", help=f"GGUF types: f32, {', '.join(QUANTIZED)}")
    parser.add_argument("--pte", action="append", default=[], metavar="NAME=PATH", help="a .pte contender")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", default=None, help="the row ratios are against (default: the first)")
    parser.add_argument("--keep", type=Path, default=None, help="write the GGUF files here, kept")
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
            "it as this script's docstring says (build with -DGGML_NATIVE=OFF) and pass --convert and "
            "--quantize-tool. Nothing was written.",
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
        rows = [*_convert(args.folder, args.convert, args.quantize_tool, types, work), *ptes]
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
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
