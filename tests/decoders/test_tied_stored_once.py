"""A tied embedding/LM head in a single ``.pte``, stored once: the lookup reads the table as a
program constant, XNNPACK's linear layer reads the same bytes as named data, and
:func:`writeback_core.stored_once.store_named_data_once` points the named data at the
constant's place in the file. ExecuTorch's stock runtime and ``TextLLMRunner`` load the file
unchanged and compute what eager PyTorch computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from writeback.cli import main
from writeback_decoders.quantize import QUANTIZATIONS, quantize

from tests.decoders.test_llm_runner import NEW_TOKENS, PROMPT
from tests.decoders.test_tied_quantized import HIDDEN, VOCAB, _prefill, _tied_llama, _weights_bytes, runner_folder

SCHEME = "8da8w"


class _TiedLookup(nn.Module):
    """An embedding and an LM head that are one ``[vocab, 64]`` fp32 parameter."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, 64)
        self.head = nn.Linear(64, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.embedding(tokens)))
        return out


def test_an_fp32_tied_table_is_stored_once_shrinking_exirs_file_by_its_size_with_eagers_output() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from writeback_core.stored_once import store_named_data_once

    torch.manual_seed(0)
    vocab = 1024
    model = _TiedLookup(vocab).eval()
    tokens = torch.tensor([[3, 1000, 59, 7]])
    exported = torch.export.export(model, (tokens,))
    config = ExecutorchBackendConfig()
    program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch(config)
    before = len(program._pte_data)
    table = model.embedding.weight.detach().numpy().tobytes()
    assert bytes(program._pte_data).count(table) == 2  # the lookup's constant and XNNPACK's weight

    records = store_named_data_once(program, config)

    data = program.buffer
    assert [(r.tensor, r.nbytes) for r in records] == [(f"float32 [{vocab}, 64]", vocab * 64 * 4)]
    assert data.count(table) == 1
    # One copy of the [1024, 64] fp32 table fewer: 262,144 bytes, and the named-data segment's
    # alignment padding (under 128 bytes) and a few bytes of the program's table more or less.
    assert vocab * 64 * 4 <= before - len(data) <= vocab * 64 * 4 + 1024, before - len(data)
    got = Runtime.get().load_program(data).load_method("forward").execute([tokens])[0]
    with torch.no_grad():
        torch.testing.assert_close(got, model(tokens), rtol=1e-5, atol=1e-5)


def test_a_program_without_shared_bytes_is_left_as_exir_wrote_it() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from writeback_core.stored_once import store_named_data_once

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    exported = torch.export.export(model, (torch.ones(1, 8),))
    config = ExecutorchBackendConfig()
    program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch(config)
    before = bytes(program.buffer)
    assert store_named_data_once(program, config) == ()
    assert program.buffer == before


def _export(folder: Path, pte: Path) -> str:
    result = CliRunner().invoke(
        main, ["export", str(folder), "--backend", "xnnpack", "--output", str(pte), "--quantize", SCHEME]
    )
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tied 8192-token folder exported 8da8w to one .pte, and what export printed."""
    folder = tmp_path_factory.mktemp("tied") / "folder"
    _tied_llama(VOCAB, seed=5).save_pretrained(folder)
    pte = folder.parent / "model.pte"
    return pte, _export(folder, pte)


def test_export_writes_a_tied_8da8w_table_once_in_a_single_pte_and_says_so(single: tuple[Path, str]) -> None:
    pte, output = single
    quantized: Any = quantize(_tied_llama(VOCAB, seed=5), SCHEME)
    embedding = quantized.model.embed_tokens
    data = pte.read_bytes()
    assert data.count(embedding.weight.numpy().tobytes()) == 1
    assert data.count(embedding.scales.numpy().tobytes()) == 1
    # Every weight once (worked out from the shapes), and the program's own table, the delegates'
    # graphs and the alignment within 64 KiB: a second copy of the table would add 557,056 bytes.
    expected = _weights_bytes(_tied_llama(VOCAB, seed=5), SCHEME)
    assert VOCAB * HIDDEN + VOCAB * 4 == 557_056
    assert expected <= len(data) <= expected + 64 * 1024, (len(data), expected)
    assert f"stored once: int8 [{VOCAB}, {HIDDEN}] (512.0 KiB), float32 [{VOCAB}] (32.0 KiB)" in " ".join(
        output.split()
    )


def test_the_stock_runtime_runs_the_single_tied_pte_as_quantized_eager_does(single: tuple[Path, str]) -> None:
    pte, _ = single
    quantized: Any = quantize(_tied_llama(VOCAB, seed=5), SCHEME)
    with torch.no_grad():
        eager = quantized(torch.tensor([[3, 141, 59, 265, 358, 979, 323]])).logits[:, -1:]
    scheme = QUANTIZATIONS[SCHEME]
    torch.testing.assert_close(_prefill(pte), eager, rtol=scheme.rtol, atol=scheme.atol)


def test_the_runner_generates_quantized_eagers_greedy_tokens_from_a_single_tied_pte(tmp_path: Path) -> None:
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    from writeback_core.llm_runner import load_runner_kernels

    folder = tmp_path / "folder"
    tokenizer, expected = runner_folder(folder, SCHEME)
    output = _export(folder, tmp_path / "model.pte")
    assert "stored once: int8" in output and not (tmp_path / "model.ptd").exists()
    assert load_runner_kernels()
    runner = TextLLMRunner(str(tmp_path / "model.pte"), str(folder / "tokenizer.json"))
    pieces: list[str] = []
    runner.generate(
        PROMPT, GenerationConfig(echo=False, max_new_tokens=NEW_TOKENS, temperature=0.0), token_callback=pieces.append
    )
    assert pieces == [tokenizer.decode([t]) for t in expected]
