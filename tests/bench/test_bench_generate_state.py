"""`writeback bench-generate` says what each contender's program moves to keep its state: the
whole-state copies left per call, their bytes, and the bytes of every state the program mutates.

Worked out by hand for a tiny Mamba folder (hidden 64, expand 2, so 128 inner channels; conv
kernel 4; SSM state 8; 2 layers; fp32): each layer's conv state is [1, 128, 4] (2,048 bytes) and
its SSM state [1, 128, 8] (4,096 bytes), 12,288 bytes for the two layers. Stock ExecuTorch on
XNNPACK writes all four back whole on every call: 4 copies, 12,288 bytes per call (12.0 KiB).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from writeback_bench.runner_generation import STOCK_SAME, WRITEBACK, GenerationRow, _programs, _table

from tests.decoders.test_hf_states import _COMMON, FAMILIES
from tests.decoders.test_llm_runner import _tokenizer

CONV = 128 * 4 * 4  # bytes: [1, 128, 4] fp32
SSM = 128 * 8 * 4  # bytes: [1, 128, 8] fp32


@pytest.fixture(scope="module")
def mamba_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    path = tmp_path_factory.mktemp("mamba")
    tokenizer = _tokenizer(path)
    config_class, fields = FAMILIES["mamba"]  # hidden 64, 2 layers, state 8, expand 2, conv kernel 4
    config = getattr(transformers, config_class)(vocab_size=tokenizer.get_vocab_size(), **_COMMON, **fields)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.slow
def test_bench_generate_counts_each_contenders_state_copies_and_bytes_per_call_as_worked_out_by_hand(
    mamba_folder: Path, tmp_path: Path
) -> None:
    from writeback.cli import resolve_model_option
    from writeback_core import load_registry

    registry = load_registry()
    case = resolve_model_option(registry, str(mamba_folder))
    written = {name: write(tmp_path / f"{i}.pte") for i, (name, _, write) in enumerate(_programs(registry, case))}
    assert sorted(written) == sorted([STOCK_SAME, WRITEBACK])
    stock = written[STOCK_SAME][1]
    assert stock is not None
    assert (stock.copies, stock.copied_bytes, stock.state_bytes) == (4, 2 * (CONV + SSM), 2 * (CONV + SSM))
    ours = written[WRITEBACK][1]
    assert ours is not None
    assert ours.state_bytes == 2 * (CONV + SSM)
    # Whatever copies writeback leaves are some of the four states, each counted whole.
    sizes = {(c, s, c * CONV + s * SSM) for c in range(3) for s in range(3)}
    assert any((ours.copies, ours.copied_bytes) == (c + s, b) for c, s, b in sizes), ours

    row = GenerationRow(STOCK_SAME, "same export", prefill=[1.0], decode=[1.0], first_token=[1.0])
    row.resident, row.peak, row.traffic, row.text = [1], [1], stock, "x"
    line = _table([row])[1]
    assert line.split()[-6:-1] == ["4", "12.0", "KiB", "12.0", "KiB"], line  # copies/call, copied/call, state
