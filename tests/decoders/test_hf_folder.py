"""hf_case on a local model folder: its weights loaded, nothing from the folder run or unpickled
(slow tier: importing transformers alone takes 10 s or more here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from writeback_decoders import hf_case, hf_config

from tests.conftest import explain_cells
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


def test_explain_of_a_folder_shows_each_cache_written_in_place_by_update_cache_nothing_copied(tmp_path: Path) -> None:
    """A folder's model runs ExecuTorch's custom ops by default: each layer's key and value
    cache is written by ``llama::update_cache``, in place, so no lowering copies it (before,
    explain of a folder crashed with a traceback)."""
    from click.testing import CliRunner
    from writeback.cli import main

    _saved_llama(tmp_path)
    result = CliRunner().invoke(main, ["explain", str(tmp_path)])
    assert result.exit_code == 0, result.output
    cells = explain_cells(result.output)
    states = [f"{kind}_cache_{layer}" for layer in range(2) for kind in ("key", "value")]  # the config's 2 layers
    header = next(line for line in result.output.splitlines() if "key_cache_0" in line)
    assert [p.strip() for p in header.strip("┃").split("┃")][1:] == states, result.output
    op = "llama::update_cache"
    assert cells["write"] == [f"in place by {op}"] * 4, result.output
    assert cells["shape"] == ["1x32x2x16"] * 4  # batch x positions x kv heads x head dim (64 / 4 heads)
    assert cells["stock copies/call"] == ["0 B"] * 4
    assert cells["stock kernels"] == [f"in place ({op}), any runtime"] * 4
    assert cells["mlx"] == [f"in place by {op} outside the delegate, 0 B/call"] * 4
