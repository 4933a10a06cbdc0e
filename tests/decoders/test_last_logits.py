"""A prefill computes only what ExecuTorch's LLM runner reads: the last position's logits.

An exported decoder cuts its hidden state to the last row before the LM head, so a call of ``n``
tokens returns ``[1, 1, vocab]`` and its program plans no ``[1, max_seq_len, vocab]`` buffer;
``writeback export --all-logits`` returns every position's. Each is checked against
transformers' own model run whole on the prompt (no cache, an independent implementation), and
the planned memory against the logits' bytes worked out by hand (slow tier: transformers and
lowerings).
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

# A vocabulary large beside the rest (hidden 64, MLP 128) so the logits are the program's largest
# activation, as at Qwen2.5-0.5B's shape.
VOCAB = 8192
CACHE = 32
PROMPT = [3, 141, 59, 265, 358, 979, 323]


def _config() -> Any:
    """writeback's tiny Llama (2 layers, hidden 64, 4 heads of 16, 32 positions) with a vocabulary of VOCAB."""
    from writeback_decoders import hf_config

    config = hf_config("llama")
    config.vocab_size, config.bos_token_id, config.eos_token_id = VOCAB, 0, 1
    assert config.max_position_embeddings == CACHE
    return config


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf-llama-wide-vocab")
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(_config()).eval().save_pretrained(path)
    return path


def _eager_logits(folder: Path) -> torch.Tensor:
    """transformers' logits of every prompt position, ``[1, n, vocab]``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([PROMPT])).logits
    return logits


def _export(folder: Path, backend: str, pte: Path, *options: str) -> str:
    result = CliRunner().invoke(main, ["export", str(folder), "--backend", backend, "--output", str(pte), *options])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _prefill(pte: Path) -> torch.Tensor:
    """The program's answer to the whole prompt in one call, in ExecuTorch's stock runtime."""
    from executorch.runtime import Runtime
    from writeback_core.llm_runner import load_runner_kernels

    assert load_runner_kernels()
    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
    got: torch.Tensor = method.execute([torch.tensor([PROMPT]), torch.arange(len(PROMPT))])[0]
    return got.clone()


@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
def test_a_prefill_returns_the_last_positions_logits_equal_to_transformers(
    folder: Path, tmp_path: Path, backend: str
) -> None:
    output = _export(folder, backend, tmp_path / "model.pte")
    assert "logits: the last position's only (what the runner reads; the LM head runs on one row)" in output
    got = _prefill(tmp_path / "model.pte")
    assert got.shape == (1, 1, VOCAB)
    torch.testing.assert_close(got, _eager_logits(folder)[:, -1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
def test_export_all_logits_returns_every_positions_logits_equal_to_transformers(
    folder: Path, tmp_path: Path, backend: str
) -> None:
    output = _export(folder, backend, tmp_path / "model.pte", "--all-logits")
    assert "logits: every position's, [1, n, vocab] for a call of n tokens (--all-logits)" in output
    assert "logits of every position returned" in output  # the model's description says it too
    got = _prefill(tmp_path / "model.pte")
    assert got.shape == (1, len(PROMPT), VOCAB)
    torch.testing.assert_close(got, _eager_logits(folder), rtol=1e-4, atol=1e-4)


def _planned_bytes(folder: Path, backend: str, all_logits: bool) -> int:
    from writeback.cli import resolve_model_option
    from writeback.model_build import export_case
    from writeback.session import assemble
    from writeback_core import load_registry
    from writeback_core.lowering import lower
    from writeback_passes.memory_report import memory_plan_report

    registry = load_registry()
    case = resolve_model_option(registry, str(folder))
    if all_logits:
        assert case.all_logits is not None
        case = case.all_logits()
    assert case.dynamic_prefill is not None
    case = case.dynamic_prefill()
    pipeline = assemble(registry, backend)
    lowered = lower(export_case(case), pipeline.registry, pipeline.backend, "state", case)
    return memory_plan_report(lowered.program).total_bytes


@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
def test_the_last_positions_logits_plan_less_memory_by_the_other_rows_logits(folder: Path, backend: str) -> None:
    """A call takes up to CACHE tokens: every position's logits are a [1, CACHE, VOCAB] fp32 buffer,
    the last one's a [1, 1, VOCAB]; the plan shrinks by the difference, (CACHE - 1) * VOCAB * 4 =
    1,015,808 bytes, give or take what else the plans hold at once."""
    every = _planned_bytes(folder, backend, all_logits=True)
    last = _planned_bytes(folder, backend, all_logits=False)
    rows = (CACHE - 1) * VOCAB * 4
    assert rows == 1_015_808
    # Besides the logits a plan holds the caches (16 KiB) and activations of [CACHE, 128] fp32 at most
    # (16 KiB each): under 100 KiB at once, laid out differently by the two plans.
    assert abs((every - last) - rows) <= 100 * 1024, (every, last, every - last, rows)


def test_every_hf_decoder_returns_the_last_positions_logits_and_every_positions_when_asked() -> None:
    """transformers' static cache (``hf-llama``) and ExecuTorch's kernels (a folder's default), eager:
    the last row of transformers' own logits by default, all of them from the ``all_logits`` form."""
    from writeback_decoders.hf import hf_case

    torch.manual_seed(5)
    reference = transformers.LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits
    for attention in ("static", "custom-ops"):
        case = hf_case(_config(), attention=attention, seed=5, max_cache_len=CACHE)
        assert case.dynamic_prefill is not None and case.all_logits is not None
        inputs = {"input_ids": torch.tensor([PROMPT]), "cache_position": torch.arange(len(PROMPT))}
        with torch.no_grad():
            last = case.dynamic_prefill().build()(**inputs)
            every = case.all_logits().build()(**inputs)
        torch.testing.assert_close(last, expected[:, -1:], rtol=1e-5, atol=1e-5, msg=attention)
        torch.testing.assert_close(every, expected, rtol=1e-5, atol=1e-5, msg=attention)


def test_et_llama_returns_the_last_positions_logits_and_every_positions_when_asked() -> None:
    """ExecuTorch's example: ``[1, vocab]`` by default (as its own export), ``[1, n, vocab]`` from the
    ``all_logits`` form, whose last row is the default's."""
    from writeback_decoders.et_llama import et_llama_case

    case = et_llama_case()
    assert case.dynamic_prefill is not None
    dynamic = case.dynamic_prefill()
    assert dynamic.all_logits is not None
    tokens = torch.tensor([[1, 7, 30, 2, 9]])
    with torch.no_grad():
        last = dynamic.build()(tokens, attn_options={"input_pos": torch.tensor([0])})
        every = dynamic.all_logits().build()(tokens, attn_options={"input_pos": torch.tensor([0])})
    assert last.shape == (1, 128) and every.shape == (1, 5, 128)
    torch.testing.assert_close(every[:, -1], last, rtol=1e-6, atol=1e-6)


def test_export_all_logits_is_refused_with_exit_2_for_a_model_that_does_not_offer_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["export", "decoder", "--all-logits", "--output", str(tmp_path / "m.pte")])
    assert result.exit_code == 2, result.output
    assert "--all-logits: model 'decoder' does not offer it" in " ".join(result.output.split())
    assert not (tmp_path / "m.pte").exists()
