"""``writeback export --separate-weights``: every weight in a data file of its own beside the
``.pte`` (ExecuTorch's program-data separation), where a tied embedding/LM head (the lookup's
table as a program constant and XNNPACK's matrix in its named data) is stored once, as in a
single ``.pte``. The pair gives the single file's logits bit for bit and
transformers' own at fp32 tolerance (slow tier: transformers and lowerings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

# A vocabulary large beside the rest (hidden 64, MLP 128), so that the tied table (2 MiB) is most of the file.
VOCAB = 8192
HIDDEN = 64
PROMPT = [3, 141, 59, 265, 358, 979, 323]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """writeback's tiny Llama with a VOCAB vocabulary and its embedding tied to its LM head."""
    from writeback_decoders import hf_config

    config: Any = hf_config("llama")
    config.vocab_size, config.bos_token_id, config.eos_token_id = VOCAB, 0, 1
    config.tie_word_embeddings = True
    assert config.hidden_size == HIDDEN
    path = tmp_path_factory.mktemp("hf-llama-tied")
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(path)
    return path


def _export(folder: Path, pte: Path, *options: str) -> str:
    result = CliRunner().invoke(main, ["export", str(folder), "--backend", "xnnpack", "--output", str(pte), *options])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _prefill(pte: Path, data: Path | None = None) -> torch.Tensor:
    """The program's last-position logits of PROMPT in one call, in ExecuTorch's stock runtime."""
    from executorch.runtime import Runtime
    from writeback_core.llm_runner import load_runner_kernels

    assert load_runner_kernels()
    program = Runtime.get().load_program(pte, data_path=data)
    got: torch.Tensor = program.load_method("forward").execute([torch.tensor([PROMPT]), torch.arange(len(PROMPT))])[0]
    return got.clone()


def test_separate_weights_stores_a_tied_embedding_and_lm_head_once_with_the_same_logits(
    folder: Path, tmp_path: Path
) -> None:
    _export(folder, tmp_path / "one.pte")
    output = _export(folder, tmp_path / "two.pte", "--separate-weights")
    assert f"wrote the weights to {tmp_path / 'two.ptd'}" in output
    assert "TextLLMRunner(PTE, TOKENIZER, two.ptd)" in output
    single = (tmp_path / "one.pte").stat().st_size
    pair = (tmp_path / "two.pte").stat().st_size + (tmp_path / "two.ptd").stat().st_size
    # Both hold the tied table (VOCAB x HIDDEN fp32, 2 MiB) once: they differ by what the data
    # file's header and the alignment of its ~20 entries add (under 8 KiB), not by the table.
    table = VOCAB * HIDDEN * 4
    assert table == 2_097_152
    assert abs(single - pair) < 8 * 1024, (single, pair, single - pair)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = model.model.embed_tokens.weight.detach().numpy().tobytes()
    assert (tmp_path / "one.pte").read_bytes().count(rows) == 1
    apart = _prefill(tmp_path / "two.pte", tmp_path / "two.ptd")
    assert torch.equal(apart, _prefill(tmp_path / "one.pte"))
    with torch.no_grad():
        eager = model(torch.tensor([PROMPT])).logits[:, -1:]
    torch.testing.assert_close(apart, eager, rtol=1e-4, atol=1e-4)


def test_export_without_separate_weights_removes_an_earlier_weights_file_beside_its_output(
    folder: Path, tmp_path: Path
) -> None:
    """The runner loads OUTPUT.ptd with OUTPUT when it is there (writeback generate, bench-generate):
    a single-file export over an earlier separate one must not leave the old weights beside it."""
    _export(folder, tmp_path / "model.pte", "--separate-weights")
    assert (tmp_path / "model.ptd").is_file()
    output = _export(folder, tmp_path / "model.pte")
    assert "wrote the weights to" not in output
    assert not (tmp_path / "model.ptd").exists()
    torch.testing.assert_close(_prefill(tmp_path / "model.pte"), _prefill(tmp_path / "model.pte"))


def test_separate_weights_refuses_an_output_ending_in_ptd_with_exit_2_writing_nothing(
    folder: Path, tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        main, ["export", str(folder), "--output", str(tmp_path / "model.ptd"), "--separate-weights"]
    )
    assert result.exit_code == 2, result.output
    assert "--separate-weights writes the weights to OUTPUT with the suffix .ptd" in " ".join(result.output.split())
    assert list(tmp_path.iterdir()) == []
