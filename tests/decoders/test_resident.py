"""Loading a `writeback export` file in ExecuTorch's LLM runner keeps one resident copy of each
weight, and `bench-generate` prints what loading costs (slow tier: a lowering of a 48 MiB model).

The folder is a Hugging Face Llama with random weights, 4 layers of width 512 (MLP 1,536, 8 heads,
4 KV heads of 64) and a tokenizer of at most 96 tokens: by hand, 2 x 96 x 512 (embedding, LM head) + 4 x (2 x
512 x 512 + 2 x 512 x 256 + 3 x 512 x 1,536 + 2 x 512) + 512 = 12,685,824 fp32 parameters,
50,743,296 bytes (48.4 MiB). XNNPACK packs every linear layer's weights for itself at load; the
runtime maps the file and unmaps what was packed from, so loading adds about the weights once.
A second copy (the file's pages kept beside the packed weights, or the file read into memory)
would add twice that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from writeback.cli import main

pytestmark = pytest.mark.slow

WEIGHT_BYTES = 4 * (2 * 96 * 512 + 4 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536 + 2 * 512) + 512)
MIB = 1 << 20
# What loading adds beside the weights: the runner, XNNPACK's workspace and thread pool, the planned
# activations (a 128-position cache of 4 x 2 x 128 x 4 x 64 fp32 is 1 MiB) and malloc's slack.
OVERHEAD = 32 * MIB
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model folder, the .pte `writeback export --backend xnnpack` wrote of it)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama-48mib")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = [PROMPT, "state that a model mutates is written once in place"] * 20
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=96, special_tokens=["<s>", "</s>"]))
    assert tokenizer.get_vocab_size() <= 96  # the model's 96 rows cover every token
    tokenizer.save(str(folder / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) * 4 == WEIGHT_BYTES
    model.save_pretrained(folder)
    pte = folder / "model.pte"
    result = CliRunner().invoke(main, ["export", str(folder), "--backend", "xnnpack", "--output", str(pte)])
    assert result.exit_code == 0, result.output
    assert "one resident copy of each weight: load the file by its path" in " ".join(result.output.split())
    return folder, pte


def test_runner_load_adds_the_weights_once_not_the_file_beside_xnnpacks_packed_copy(
    exported: tuple[Path, Path],
) -> None:
    from writeback_bench.resident_memory import measure_in_child

    folder, pte = exported
    figures = measure_in_child(pte, folder / "tokenizer.json", PROMPT, 4)
    assert figures.text
    # XNNPACK's packed fp32 weights are at least the weights; the file's pages are let go.
    assert 0.9 * WEIGHT_BYTES <= figures.resident_added <= WEIGHT_BYTES + OVERHEAD, figures
    assert figures.file_added <= 0.25 * WEIGHT_BYTES, figures
    assert figures.resident_added <= figures.peak_added <= WEIGHT_BYTES + 2 * OVERHEAD, figures
    assert 0 < figures.load_s <= figures.first_token_s


def test_bench_generate_prints_file_load_resident_peak_and_speed_columns_within_hand_bounds(
    exported: tuple[Path, Path],
) -> None:
    folder, pte = exported
    command = ["bench-generate", str(folder), "--pte", f"ours={pte}", "--pte", f"again={pte}", "--only-pte"]
    result = CliRunner().invoke(main, [*command, "--rounds", "2", "--prompt-tokens", "8", "--new-tokens", "4"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line for line in lines if line.startswith("contender"))
    columns = ["file MiB", "load s", "resident MiB", "peak MiB", "prefill tok/s", "decode tok/s"]
    ratios = ["load x", "resident x", "peak x", "prefill x", "decode x"]
    for name in [*columns, *ratios]:
        assert name in header, (name, header)
    for row_name in ("ours", "again"):
        row = next(line for line in lines if line.startswith(f"{row_name} ")).split()
        file_mib, load_s, resident_mib, peak_mib, prefill, decode = (float(v) for v in row[1:7])
        assert file_mib == pytest.approx(pte.stat().st_size / MIB, abs=0.05)
        assert WEIGHT_BYTES / MIB <= file_mib <= WEIGHT_BYTES / MIB + 1
        assert 0 < load_s < 60
        assert 0.9 * WEIGHT_BYTES / MIB <= resident_mib <= (WEIGHT_BYTES + OVERHEAD) / MIB
        assert resident_mib <= peak_mib <= (WEIGHT_BYTES + 2 * OVERHEAD) / MIB
        assert prefill > 0 and decode > 0
        if row_name == "ours":  # the baseline: every ratio against itself
            assert row[7:12] == ["1.00"] * 5, row
