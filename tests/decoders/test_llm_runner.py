"""`writeback export` on a local Hugging Face folder, then ExecuTorch's own LLM runner
(``TextLLMRunner``): the greedy tokens equal transformers' ``generate`` with a static cache
(slow tier: transformers and a lowering per backend).

The folder holds random weights from a small Llama config and a byte-level BPE tokenizer
trained here on ASCII text (every token decodes alone, so the runner's pieces are the
tokens). The weights' seed is chosen so that every greedy step's top-2 logit margin is
well above float32 noise.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main

pytestmark = pytest.mark.slow

PROMPT = "the quick brown"
NEW_TOKENS = 12
TEXT = ["the quick brown fox jumps over the lazy dog", "state that a model mutates is written once in place"] * 20


def _tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=96, special_tokens=["<s>", "</s>"]))
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer


def _greedy(model: Any, ids: list[int]) -> tuple[list[int], float]:
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_implementation="static",
        output_scores=True,
        return_dict_in_generate=True,
    )
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(ids) :].tolist(), min(margins)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A model folder and the pieces of transformers' greedy continuation of PROMPT."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("hf-llama")
    tokenizer = _tokenizer(path)
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
    ids = tokenizer.encode(PROMPT).ids
    for seed in range(50):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        tokens, margin = _greedy(model, ids)
        if margin > 1e-3 and 1 not in tokens:
            break
    else:
        pytest.fail("no seed of 50 gives greedy steps with a top-2 margin above 1e-3")
    model.save_pretrained(path)
    return path, [tokenizer.decode([t]) for t in tokens]


def runner_generates(pte: Path, tokenizer: Path) -> tuple[list[str], list[Any]]:
    """The pieces and statistics ``TextLLMRunner`` gives for PROMPT, greedy, NEW_TOKENS new tokens."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    runner = TextLLMRunner(str(pte), str(tokenizer))
    pieces: list[str] = []
    stats: list[Any] = []
    config = GenerationConfig(echo=False, max_new_tokens=NEW_TOKENS, temperature=0.0)
    runner.generate(PROMPT, config, token_callback=pieces.append, stats_callback=stats.append)
    return pieces, stats


def _export(model: Path, backend: str, out: Path, *options: str) -> str:
    command = ["export", str(model), "--backend", backend, "--output", str(out / "model.pte"), *options]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def exported(
    folder: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., tuple[Path, str]]:
    """``exported(backend, *options)``: the folder's ``writeback export`` with those arguments, made
    once in this module (several tests read the same export): the directory holding its
    ``model.pte`` and ``tokenizer.json``, and what the command printed. Tests only read them."""
    made: dict[tuple[str, ...], tuple[Path, str]] = {}

    def export(backend: str, *options: str) -> tuple[Path, str]:
        key = (backend, *options)
        if key not in made:
            out = tmp_path_factory.mktemp("export")
            made[key] = (out, _export(folder[0], backend, out, *options))
        return made[key]

    return export


@pytest.mark.parametrize(
    ("backend", "prefill"),
    [("xnnpack", "one-call"), ("portable", "one-call"), ("xnnpack", "token-by-token")],
)
def test_the_runner_generates_transformers_greedy_tokens_from_an_exported_folder(
    folder: tuple[Path, list[str]], exported: Callable[..., tuple[Path, str]], backend: str, prefill: str
) -> None:
    from writeback_core.llm_runner import load_runner_kernels

    assert load_runner_kernels()  # the folder's attention runs ExecuTorch's llama:: kernels
    model, expected = folder
    if prefill == "one-call":
        out, output = exported(backend)
        assert "get_max_seq_len=64, get_max_context_len=64" in output
        assert "enable_dynamic_shape=True" in output
        assert "prefill: the whole prompt in one call (up to 64 tokens)" in output
        assert "logits: the last position's only (what the runner reads;" in output
    else:
        out, output = exported(backend, "--token-by-token")
        assert "get_max_seq_len=1, get_max_context_len=64" in output
        assert "enable_dynamic_shape=False" in output
        assert "prefill: one token per call" in output
        assert "logits: the one position of a call (one token per call)" in output
    assert "written by llama::update_cache, read by llama::custom_sdpa" in " ".join(output.split())
    for cache in ("key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"):
        assert f"{cache} (8.0 KiB): program buffer; no copy left" in output
    assert (out / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    pieces, stats = runner_generates(out / "model.pte", out / "tokenizer.json")
    assert pieces == expected
    assert stats[-1].num_prompt_tokens == 3


@pytest.mark.parametrize("scheme", ["8da4w", "8da4w-e8", "8da8w"])
def test_the_runner_generates_quantized_eagers_greedy_tokens_from_a_folder_exported_quantized(
    folder: tuple[Path, list[str]], exported: Callable[..., tuple[Path, str]], tmp_path: Path, scheme: str
) -> None:
    """`export --quantize SCHEME`: each token TextLLMRunner generates is the top choice of
    transformers' eager model with the same quantized weights fed the same sequence, within the
    integer kernels' rounding (0.05 of a logit); the caches still written in place; the 8-bit
    embedding's lookup runs on the runner's quantized kernels."""
    from transformers import AutoModelForCausalLM
    from writeback_decoders.quantize import QUANTIZATIONS, quantize

    model, _ = folder
    out, output = exported("xnnpack", "--quantize", scheme)
    assert QUANTIZATIONS[scheme].description in " ".join(output.split())
    for cache in ("key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"):
        assert f"{cache} (8.0 KiB): program buffer; no copy left" in output
    pieces, _ = runner_generates(out / "model.pte", out / "tokenizer.json")
    tokenizer = _tokenizer(tmp_path)  # the same training text: the same vocabulary
    ids = {tokenizer.decode([i]): i for i in range(tokenizer.get_vocab_size())}
    prompt = tokenizer.encode(PROMPT).ids
    generated = [ids[piece] for piece in pieces]
    assert len(generated) == NEW_TOKENS
    plain = AutoModelForCausalLM.from_pretrained(model).eval()
    weights = sum(p.numel() * 4 for p in plain.parameters())
    quantized_bytes = sum(m.weight.numel() * 4 for m in plain.modules() if isinstance(m, torch.nn.Linear))
    if QUANTIZATIONS[scheme].embedding_bits is not None:
        quantized_bytes += sum(m.weight.numel() * 4 for m in plain.modules() if isinstance(m, torch.nn.Embedding))
    # 4-bit weights and a scale per 32 keep about a sixth of their fp32 bytes (saving over 70 %
    # beside the file's ~45 KB of program and metadata); 8-bit ones a quarter and a scale per
    # row or channel (74 %, over 55 % net of that overhead at this size).
    saved = 0.7 if QUANTIZATIONS[scheme].linear_bits == 4 else 0.55
    size = (out / "model.pte").stat().st_size
    assert size < weights - saved * quantized_bytes, (size, weights, quantized_bytes)
    quantized = quantize(plain, scheme)
    with torch.no_grad():
        logits = quantized(torch.tensor([prompt + generated])).logits[0]
    for step, token in enumerate(generated):
        row = logits[len(prompt) - 1 + step]
        assert row[token] >= row.max() - 0.05, (step, token, int(row.argmax()), float(row.max() - row[token]))


def test_generate_streams_the_runners_text_and_prints_its_statistics(
    folder: tuple[Path, list[str]], exported: Callable[..., tuple[Path, str]]
) -> None:
    _, expected = folder
    out, _ = exported("xnnpack")
    command = [sys.executable, "-m", "writeback", "generate", str(out / "model.pte"), "--prompt", PROMPT]
    done = subprocess.run([*command, "--max-new-tokens", str(NEW_TOKENS)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "".join(expected) in done.stdout
    assert f"new tokens {NEW_TOKENS} (1 from the prefill call, {NEW_TOKENS - 1} decoded)" in done.stdout
    assert "prefill " in done.stdout and " tokens/s" in done.stdout and "time to first token" in done.stdout


def test_generate_loads_the_weights_file_an_export_with_separate_weights_writes_beside_the_pte(
    folder: tuple[Path, list[str]], exported: Callable[..., tuple[Path, str]], tmp_path: Path
) -> None:
    """`export --quantize 8da4w-e8 --separate-weights`: the .pte holds no weight (every one, XNNPACK's
    4-bit matrices and the 8-bit table, is in model.ptd); `writeback generate` loads the pair and
    gives the tokens the single-file export gives."""
    model, _ = folder
    one, _ = exported("xnnpack", "--quantize", "8da4w-e8")  # the single-file export
    output = _export(model, "xnnpack", tmp_path, "--quantize", "8da4w-e8", "--separate-weights")
    assert "wrote the weights to" in output
    pte, data = (tmp_path / "model.pte").stat().st_size, (tmp_path / "model.ptd").stat().st_size
    single_size = (one / "model.pte").stat().st_size
    # What left the .pte is what the data file holds, give or take their headers and alignment.
    assert abs((single_size - pte) - data) < 8 * 1024, (single_size, pte, data)
    single, _ = runner_generates(one / "model.pte", one / "tokenizer.json")
    command = [sys.executable, "-m", "writeback", "generate", str(tmp_path / "model.pte"), "--prompt", PROMPT]
    done = subprocess.run([*command, "--max-new-tokens", str(NEW_TOKENS)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "".join(single) in done.stdout


def test_export_refuses_a_folder_no_plugin_reads_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    result = CliRunner().invoke(main, ["export", str(tmp_path), "--output", str(tmp_path / "m.pte")])
    assert result.exit_code == 2, result.output
    assert "no installed plugin reads a model from" in result.output
    assert not (tmp_path / "m.pte").exists()


def test_export_refuses_a_model_breaking_the_runner_contract_writing_nothing(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["export", "decoder-caller-cache", "--output", str(tmp_path / "m.pte")])
    assert result.exit_code == 2, result.output
    assert "carries no runner metadata" in result.output
    assert not (tmp_path / "m.pte").exists()


MODEL_FILE = """
import torch
from writeback_core.llm_runner import runner_metadata
from writeback_core.types import ModelCase


class TwoOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 5))

    def forward(self, tokens, positions):
        self.cache.index_copy_(0, positions, tokens.float().expand(1, 5))
        logits = self.cache.sum(0).reshape(1, 1, 5)
        return logits, logits * 2


def case():
    return ModelCase(
        name="two-outputs",
        description="a decoder returning its logits twice",
        build=TwoOutputs,
        step_inputs=lambda step: (torch.tensor([[1]]), torch.tensor([step])),
        constant_methods=runner_metadata(
            max_seq_len=1, max_context_len=8, vocab_size=5, bos_id=0, eos_ids=[1], dynamic_shape=False
        ),
    )
"""


def test_export_refuses_a_program_with_two_outputs_naming_it_and_writing_nothing(tmp_path: Path) -> None:
    (tmp_path / "two.py").write_text(MODEL_FILE)
    result = CliRunner().invoke(main, ["export", f"{tmp_path / 'two.py'}:case", "--output", str(tmp_path / "m.pte")])
    assert result.exit_code == 2, result.output
    assert "does not fit ExecuTorch's LLM runner" in result.output
    assert "forward returns 2 outputs; the runner takes exactly one" in result.output
    assert not (tmp_path / "m.pte").exists()


def _mapped_bench_ptes() -> set[str]:
    """The bench's ``.pte`` files this process maps now (a loaded runner maps its program)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[-1] for line in lines if "writeback-bench-generate-" in line and line.endswith(".pte")}


def test_bench_generate_times_each_contender_in_a_runner_of_its_own_one_loaded_at_a_time_all_giving_one_text(
    folder: tuple[Path, list[str]],
) -> None:
    from writeback.cli import resolve_model_option
    from writeback_bench.runner_generation import STOCK_SAME, WRITEBACK, bench_generation
    from writeback_core import load_registry

    model, expected = folder
    registry = load_registry()
    case = resolve_model_option(registry, str(model))
    assert case.dynamic_prefill is not None
    mapped: list[tuple[str, set[str]]] = []
    rows = bench_generation(
        registry,
        case.dynamic_prefill(),
        model / "tokenizer.json",
        3,
        NEW_TOKENS,
        rounds=2,
        on_progress=lambda line: mapped.append((line, _mapped_bench_ptes())),
    )
    # Before each generation no contender's program is loaded: each generation loads its own
    # runner and drops it after (three 0.5B contenders loaded together passed 16 GB).
    generations = [(line, files) for line, files in mapped if line.startswith("generating ")]
    assert len(generations) == 6
    assert [files for _, files in generations] == [set()] * 6, generations
    names = [r.name for r in rows]
    assert names == ["stock+xnnpack (transformers StaticCache)", STOCK_SAME, WRITEBACK]
    for row in rows:
        assert row.error is None, (row.name, row.error)
        assert len(row.prefill) == len(row.decode) == len(row.resident) == len(row.peak) == 2
        # The bench's prompt is its own text; every contender must generate the same greedy text.
        assert row.text == rows[-1].text, row.name
    # On the fixture's prompt the runner of writeback's program gives transformers' tokens (checked
    # above per backend); here the bench's text is non-empty and made of the tokenizer's pieces.
    assert rows[-1].text and expected


def test_bench_generate_runs_a_pte_written_elsewhere_alone_against_itself(
    folder: tuple[Path, list[str]], tmp_path: Path
) -> None:
    model, _ = folder
    _export(model, "xnnpack", tmp_path)
    pte = tmp_path / "model.pte"
    command = ["bench-generate", str(model), "--pte", f"given={pte}", "--only-pte", "--baseline", "given"]
    result = CliRunner().invoke(main, [*command, "--rounds", "1", "--prompt-tokens", "3", "--new-tokens", "4"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("given ")]
    assert len(rows) == 1, result.output
    assert rows[0].split()[7:12] == ["1.00"] * 5  # load, resident, peak, prefill, decode: against itself
    assert "x = ratio to 'given'" in result.output
    assert "writeback+xnnpack" not in result.output  # --only-pte: the model's own contenders do not run


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--pte", "no-equals-sign"], "'no-equals-sign' is not NAME=PATH"),
        (["--pte", "x=/nonexistent/model.pte"], "(contender 'x') is not a file"),
        (["--only-pte"], "--only-pte needs at least one --pte NAME=PATH"),
    ],
)
def test_bench_generate_refuses_a_bad_pte_option_with_exit_2_before_lowering(
    folder: tuple[Path, list[str]], options: list[str], message: str
) -> None:
    model, _ = folder
    result = CliRunner().invoke(main, ["bench-generate", str(model), *options])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_bench_generate_quantize_lowers_every_contender_of_the_model_with_8da4w_weights_all_giving_one_text(
    folder: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench-generate --quantize 8da4w`: the stock contenders (transformers' StaticCache, the same
    export) are quantized as writeback's program is, so the rows compare like with like."""
    import writeback_bench.runner_generation as bench
    from transformers import AutoModelForCausalLM

    model, _ = folder
    sizes: dict[str, int] = {}
    generate = bench._generate

    def measured(row: Any, path: Path, *rest: Any) -> None:  # the real generation, the .pte's size noted
        sizes[row.name] = path.stat().st_size
        generate(row, path, *rest)

    monkeypatch.setattr(bench, "_generate", measured)
    command = ["bench-generate", str(model), "--quantize", "8da4w", "--rounds", "1", "--prompt-tokens", "3"]
    result = CliRunner().invoke(main, [*command, "--new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "4-bit weights in groups of 32" in " ".join(result.output.split())
    rows = [line for line in result.output.splitlines() if line.startswith(("stock+xnnpack", "writeback+xnnpack"))]
    assert len(rows) == 3, result.output
    assert [line.rstrip().endswith("same as writeback") for line in rows] == [True, True, False], result.output
    plain = AutoModelForCausalLM.from_pretrained(model)
    weights = sum(p.numel() * 4 for p in plain.parameters())
    linear = sum(m.weight.numel() * 4 for m in plain.modules() if isinstance(m, torch.nn.Linear))
    assert len(sizes) == 3, sizes
    # 4-bit weights keep about a sixth of the linear layers' bytes; a stock program also carries its
    # caches' initial values. Unquantized, every .pte holds at least all the weights.
    for name, size in sizes.items():
        assert size < weights - 0.5 * linear, (name, size, weights, linear)
