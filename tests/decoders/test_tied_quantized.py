"""``--quantize 8da4w-e8`` and ``8da8w`` on a folder whose embedding is tied to its LM head: the
head is 8-bit per output channel with the embedding's own int8 table and scales, so that with
``--separate-weights`` the data file holds the ``[vocab, hidden]`` table once (ExecuTorch's data
store keeps bytes that the lookup's constant and XNNPACK's weight share once). The pair's logits
match eager PyTorch running the same quantized model at the scheme's tolerance, and
``TextLLMRunner`` generates that eager model's greedy tokens (slow tier: transformers, lowerings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from writeback.cli import main
from writeback_decoders.quantize import QUANTIZATIONS, ByteEmbedding, quantize

from tests.decoders.test_llm_runner import NEW_TOKENS, PROMPT, _tokenizer

SCHEMES = ["8da4w-e8", "8da8w"]
each_scheme_slow = pytest.mark.parametrize("name", [pytest.param(s, marks=pytest.mark.slow) for s in SCHEMES])

# A vocabulary large beside the rest (hidden 64, MLP 128, 2 layers), so that the tied table is most of the file.
VOCAB = 8192
HIDDEN = 64
PROMPT_IDS = [3, 141, 59, 265, 358, 979, 323]


def _tied_llama(vocab: int, seed: int) -> Any:
    """writeback's tiny Llama config (hidden 64, 2 layers) with ``vocab`` tokens and its embedding
    tied to its LM head, random weights from ``seed``."""
    import transformers
    from writeback_decoders import hf_config

    config: Any = hf_config("llama")
    config.vocab_size, config.bos_token_id, config.eos_token_id = vocab, 0, 1
    config.tie_word_embeddings = True
    config.max_position_embeddings = 64
    assert config.hidden_size == HIDDEN
    torch.manual_seed(seed)
    model: Any = transformers.LlamaForCausalLM(config)
    model.eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def test_a_tied_lm_head_is_8_bit_per_channel_and_the_embedding_reads_its_int8_table_and_scales() -> None:
    for name in SCHEMES:
        model: Any = nn.Sequential(nn.Embedding(16, 64), nn.Linear(64, 64), nn.Linear(64, 16, bias=False))
        model[2].weight = model[0].weight
        table = model[0].weight.detach().clone()
        quantize(model, name)
        embedding, body, head = model[0], model[1].weight, model[2].weight
        assert isinstance(embedding, ByteEmbedding)
        # The head: 8-bit, one scale per output channel (a block is a whole row of 64), whatever the scheme's bits.
        assert (head.target_dtype, head.block_size) == (torch.int8, (1, 64))
        assert torch.equal(embedding.weight, head.qdata)
        assert torch.equal(embedding.scales, head.scale.reshape(-1))
        # Both read the fp32 table within half a step of its row's scale.
        rows = embedding(torch.arange(16)[None])[0]
        assert ((rows - table).abs() <= embedding.scales[:, None] / 2 + 1e-6).all()
        assert torch.equal(rows, head.dequantize())
        # A linear layer tied to nothing keeps the scheme's bits and grouping.
        bits = QUANTIZATIONS[name].linear_bits
        assert (body.target_dtype, body.block_size) == (
            torch.int4 if bits == 4 else torch.int8,  # type: ignore[attr-defined]  # in torch, missing from its stubs
            (1, QUANTIZATIONS[name].group_size or 64),
        )


def test_8da4w_e8_keeps_an_untied_lm_head_4_bit_in_groups_of_32() -> None:
    model: Any = nn.Sequential(nn.Embedding(16, 64), nn.Linear(64, 16, bias=False))
    quantize(model, "8da4w-e8")
    head = model[1].weight
    assert (head.target_dtype, head.block_size) == (torch.int4, (1, 32))  # type: ignore[attr-defined]  # as above
    assert isinstance(model[0], ByteEmbedding) and model[0].scales.shape == (16,)


def _export(folder: Path, pte: Path, *options: str) -> None:
    result = CliRunner().invoke(main, ["export", str(folder), "--backend", "xnnpack", "--output", str(pte), *options])
    assert result.exit_code == 0, result.output


def _prefill(pte: Path, data: Path | None = None) -> torch.Tensor:
    """The program's last-position logits of PROMPT_IDS in one call, in ExecuTorch's stock runtime."""
    from executorch.runtime import Runtime
    from writeback_core.llm_runner import load_runner_kernels

    assert load_runner_kernels()
    program = Runtime.get().load_program(pte, data_path=data)
    inputs = [torch.tensor([PROMPT_IDS]), torch.arange(len(PROMPT_IDS))]
    got: torch.Tensor = program.load_method("forward").execute(inputs)[0]
    return got.clone()


def _weights_bytes(model: nn.Module, name: str) -> int:
    """What the data file must hold, worked out from the shapes: the tied table once (int8 and an
    fp32 scale per row), every other linear layer at the scheme's bits (4-bit: two weights a byte and
    a bf16 scale per 32; 8-bit: a byte each and an fp32 scale per output channel), fp32 biases and
    norms."""
    bits = QUANTIZATIONS[name].linear_bits
    total = VOCAB * HIDDEN + VOCAB * 4
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features != VOCAB:
            weights = module.in_features * module.out_features
            total += weights // 2 + weights // 32 * 2 if bits == 4 else weights + module.out_features * 4
            total += 0 if module.bias is None else module.out_features * 4
        elif "Norm" in type(module).__name__:
            total += HIDDEN * 4
    return total


@each_scheme_slow
def test_separate_weights_stores_a_tied_quantized_table_once_with_quantized_eagers_logits(
    tmp_path: Path, name: str
) -> None:
    folder = tmp_path / "folder"
    _tied_llama(VOCAB, seed=5).save_pretrained(folder)
    _export(folder, tmp_path / "one.pte", "--quantize", name)
    _export(folder, tmp_path / "two.pte", "--quantize", name, "--separate-weights")
    data = (tmp_path / "two.ptd").read_bytes()
    expected = _weights_bytes(_tied_llama(VOCAB, seed=5), name)
    # Every weight once; the norms (all ones here, so kept once) counted each, the file's header,
    # alignment and the rotary table within 8 KiB. A second copy of the table would add 557,056 bytes.
    table = VOCAB * HIDDEN + VOCAB * 4
    assert table == 557_056
    assert expected - 2048 <= len(data) <= expected + 8 * 1024, (len(data), expected)
    # The eager model's int8 table is in the data file once, and in the single file once too (the
    # lookup's constant, which XNNPACK's named data points at).
    quantized: Any = quantize(_tied_llama(VOCAB, seed=5), name)
    embedding = quantized.model.embed_tokens
    assert isinstance(embedding, ByteEmbedding)
    rows = embedding.weight.numpy().tobytes()
    assert data.count(rows) == 1
    assert (tmp_path / "one.pte").read_bytes().count(rows) == 1
    apart = _prefill(tmp_path / "two.pte", tmp_path / "two.ptd")
    assert torch.equal(apart, _prefill(tmp_path / "one.pte"))
    with torch.no_grad():
        eager = quantized(torch.tensor([PROMPT_IDS])).logits[:, -1:]
    scheme = QUANTIZATIONS[name]
    torch.testing.assert_close(apart, eager, rtol=scheme.rtol, atol=scheme.atol)


def _greedy(model: nn.Module, ids: list[int]) -> tuple[list[int], float]:
    """Eager greedy decoding of NEW_TOKENS tokens, the whole sequence recomputed each step; the
    smallest top-2 logit margin on the way."""
    tokens: list[int] = []
    margin = float("inf")
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids + tokens])).logits[0, -1]
            top = logits.topk(2).values
            margin = min(margin, float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
    return tokens, margin


def runner_folder(folder: Path, name: str) -> tuple[Any, list[int]]:
    """A tied folder with a small tokenizer (the runner's test one) at ``folder``, its seed one
    whose quantized greedy steps each win by more than the scheme's tolerance, so that the
    integer kernels' rounding cannot change a token; the tokenizer and those steps' tokens."""
    folder.mkdir()
    tokenizer = _tokenizer(folder)
    ids = tokenizer.encode(PROMPT).ids
    for seed in range(50):
        quantized = quantize(_tied_llama(tokenizer.get_vocab_size(), seed), name)
        expected, margin = _greedy(quantized, ids)
        if margin > 2 * QUANTIZATIONS[name].atol and 1 not in expected:
            _tied_llama(tokenizer.get_vocab_size(), seed).save_pretrained(folder)
            return tokenizer, expected
    pytest.fail("no seed of 50 gives quantized greedy steps with a top-2 margin above the tolerance")


@each_scheme_slow
def test_the_runner_generates_quantized_eagers_greedy_tokens_from_a_tied_folder_with_separate_weights(
    tmp_path: Path, name: str
) -> None:
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    from writeback_core.llm_runner import load_runner_kernels

    folder = tmp_path / "folder"
    tokenizer, expected = runner_folder(folder, name)
    _export(folder, tmp_path / "model.pte", "--quantize", name, "--separate-weights")
    assert (tmp_path / "model.ptd").is_file()
    assert load_runner_kernels()
    runner = TextLLMRunner(str(tmp_path / "model.pte"), str(folder / "tokenizer.json"), str(tmp_path / "model.ptd"))
    pieces: list[str] = []
    config = GenerationConfig(echo=False, max_new_tokens=NEW_TOKENS, temperature=0.0)
    runner.generate(PROMPT, config, token_callback=pieces.append)
    assert pieces == [tokenizer.decode([t]) for t in expected]
