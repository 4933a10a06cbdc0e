"""hf_case on a local model folder: its weights loaded, nothing from the folder run or unpickled
(slow tier: importing transformers alone takes 10 s or more here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from writeback_decoders import hf_case, hf_config

from tests.decoders.cases import cache_bytes, fed

pytestmark = pytest.mark.slow


def _saved_llama(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(hf_config("llama")).eval()
    model.save_pretrained(folder)
    return model


def test_hf_case_loads_a_local_folder_with_its_weights(tmp_path: Path) -> None:
    saved = _saved_llama(tmp_path)
    case = hf_case(tmp_path, max_cache_len=16)
    assert case.name == "hf-llama" and case.strict
    module = case.build()
    loaded = module.model  # the integration's wrapper keeps the causal LM as .model
    for key, value in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert cache_bytes(module) == 2 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv heads x positions x dim x fp32
    token = fed(case, 1)[0]
    with torch.no_grad():
        logits = saved(input_ids=torch.tensor([[1]])).logits
    assert token == int(logits[0, -1].argmax())


def test_hf_case_refuses_a_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no model folder with a config.json at .*nothing is downloaded"):
        hf_case(tmp_path / "missing")


def test_hf_case_never_unpickles_weights_from_a_folder(tmp_path: Path) -> None:
    saved = _saved_llama(tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    torch.save(saved.state_dict(), tmp_path / "pytorch_model.bin")
    case = hf_case(tmp_path)
    with pytest.raises(OSError, match="safetensors"):
        case.build()
