"""A model folder's fp32 weights, mapped from its safetensors file by ``from_pretrained``, give
their pages back as each is quantized: after ``quantize`` the file's map holds only what stays
fp32 (norms), not the file (slow tier: transformers)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from writeback_decoders import hf_config
from writeback_decoders.quantize import quantize

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps"),
]


def _file_resident_kib(path: Path) -> int:
    """``Rss`` (kB) of every map of the file ``path``, from ``/proc/self/smaps`` (other tests in
    the same process may still map files of the same name elsewhere)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) == 6 and head[5] == str(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_quantizing_a_folders_model_gives_back_the_fp32_files_pages_and_keeps_its_answers(tmp_path: Path) -> None:
    import transformers

    auto: Any = transformers.AutoModelForCausalLM
    config = hf_config("llama")
    config.vocab_size, config.hidden_size, config.intermediate_size = 4096, 256, 512  # 6 MiB of fp32
    torch.manual_seed(3)
    auto.from_config(config).save_pretrained(tmp_path)
    weights = (tmp_path / "model.safetensors").resolve()
    file_bytes = weights.stat().st_size
    model = auto.from_pretrained(tmp_path, dtype=torch.float32).eval().requires_grad_(False)
    tokens = torch.tensor([[1, 5, 9]])
    assert all(torch.isfinite(p).all() for p in model.parameters())  # reads every weight: the file is resident
    assert _file_resident_kib(weights) * 1024 >= 0.9 * file_bytes
    quantize(model, "8da8w")
    after = _file_resident_kib(weights)
    assert after * 1024 < file_bytes / 8, f"{after} kB of the file still resident of {file_bytes} bytes"
    # What was given back reads back from the file: a fresh load quantized the same way answers alike.
    fresh = quantize(auto.from_pretrained(tmp_path, dtype=torch.float32).eval(), "8da8w")
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, fresh(tokens).logits)
