"""``--quantize 8da4w``: Hugging Face decoders with 4-bit weights and 8-bit dynamic activations
through the one lowering path and XNNPACK, every step checked against eager PyTorch running the
same quantized model, the caches still written in place. Slow: transformers and torchao imports
and a lowering each take 10-20 s here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from writeback.cli import main
from writeback.run import run_model
from writeback.session import assemble
from writeback_core.lowered import state_places
from writeback_core.registry import load_registry
from writeback_decoders import hf_case, hf_config
from writeback_decoders.quantize import QUANTIZATIONS, QuantizationError, quantize

from tests.decoders.cases import call

pytestmark = pytest.mark.slow

STEPS = 4


def _linear_bytes(module: nn.Module) -> int:
    """fp32 bytes of the linear weights 8da4w quantizes (input width a multiple of 32)."""
    return sum(m.weight.numel() * 4 for m in module.modules() if isinstance(m, nn.Linear) and m.in_features % 32 == 0)


@pytest.mark.parametrize("attention", ["static", "custom-ops"])
def test_quantized_decoder_matches_quantized_eager_with_caches_in_place_and_4_bit_weights(
    tmp_path: Path, attention: str
) -> None:
    fp32 = hf_case(hf_config("llama"), attention=attention)
    case = fp32.quantized("8da4w") if fp32.quantized is not None else pytest.fail("hf_case offers no quantization")
    assert case.name == "hf-llama-8da4w" and "4-bit weights in groups of 32" in case.description
    assert (case.rtol, case.atol) == (QUANTIZATIONS["8da4w"].rtol, QUANTIZATIONS["8da4w"].atol)

    # The quantization took effect: eager's quantized logits are not fp32's.
    plain, quantized = fp32.build(), case.build()
    assert (call(case, quantized, 0) - call(fp32, plain, 0)).abs().max() > 1e-3

    pipeline = assemble(load_registry(), "xnnpack")
    report = run_model(pipeline, case, STEPS, tmp_path / "q.pte")
    assert report.checked and report.failures == [], report.failures
    assert all(check is not None and check.output_error > 0 for _, check in report.steps)  # integer kernels ran
    for place in state_places(report.lowered):
        if "cache" in place.mutation.target and "cumulative" not in place.mutation.target:
            assert place.copy_bytes == 0, place

    # 4-bit weights and a scale per 32: the linear layers shrink to about a sixth of their fp32 bytes.
    reference = run_model(pipeline, fp32, 1, tmp_path / "f.pte")
    saved = reference.lowered.pte_nbytes - report.lowered.pte_nbytes
    assert saved > 0.7 * _linear_bytes(plain), (saved, _linear_bytes(plain))


def test_quantize_refuses_an_unknown_scheme_and_a_model_it_cannot_group_changing_nothing() -> None:
    layer = nn.Linear(48, 8)
    before = layer.weight.detach().clone()
    with pytest.raises(QuantizationError, match=r"unknown quantization .4bit.; offered: 8da4w, 8da4w-e8, 8da8w"):
        quantize(layer, "4bit")
    with pytest.raises(QuantizationError, match=r"no linear layer's input width divides by the group size 32 .*48"):
        quantize(layer, "8da4w")
    assert type(layer.weight) is nn.Parameter and torch.equal(layer.weight, before)

    config = hf_config("llama")
    config.hidden_size = 48
    odd = hf_case(config)
    assert odd.quantized is not None
    with pytest.raises(QuantizationError, match=r"hidden size 48 does not divide by the group size 32"):
        odd.quantized("8da4w")


def test_run_quantize_refuses_a_model_without_quantization_with_exit_2() -> None:
    result = CliRunner().invoke(main, ["run", "decoder-caller-cache", "--quantize", "8da4w", "--steps", "1"])
    assert result.exit_code == 2, result.output
    assert "model 'decoder-caller-cache' does not offer it (schemes it takes: none)" in " ".join(result.output.split())


def test_run_takes_greedy_tokens_from_its_reference_building_no_third_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked: one build for export, copied for the eager reference, whose logits give the next
    token. --no-check: one build, the program's logits give it."""
    import writeback_decoders.hf as hf

    loads: list[int] = []
    real = hf._load

    def counted(*args: object) -> nn.Module:
        loads.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(hf, "_load", counted)
    pipeline = assemble(load_registry(), "xnnpack")
    report = run_model(pipeline, hf_case(hf_config("llama")), STEPS, tmp_path / "a.pte")
    # --eager-weights auto keeps a copy of the exported build for eager here (it fits memory).
    assert report.checked and report.failures == [] and len(loads) == 1
    loads.clear()
    unchecked = run_model(pipeline, hf_case(hf_config("llama")), STEPS, tmp_path / "b.pte", check=False)
    assert not unchecked.checked and len(loads) == 1
    # Same tokens either way: the program's greedy choice is eager's here.
    fed = [r.outputs[0].argmax().item() for r, _ in unchecked.steps]
    assert fed == [r.outputs[0].argmax().item() for r, _ in report.steps]
