"""A .pte that `writeback run --output` wrote, fed what a careless or hostile caller feeds it:
out-of-range token ids raise an error naming the op, the index and the size, and the caller's
caches are left exactly as they were (eager PyTorch raises ``IndexError`` for the same ids)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main
from writeback.zoo import CallerCacheDecoder, DecoderConfig, decoder_case
from writeback_pybind_runtime import DelegateError, Runtime


@pytest.fixture(scope="module")
def pte(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "decoder.pte"
    result = CliRunner().invoke(main, ["run", "decoder-caller-cache", "--steps", "1", "--output", str(path)])
    assert result.exit_code == 0, result.output
    return path


@pytest.mark.parametrize("token", [64, 65, 1 << 40, -1])
def test_out_of_range_token_through_run_output_pte_raises_caches_unchanged(pte: Path, token: int) -> None:
    cfg = DecoderConfig()
    case = decoder_case(cfg, caller_cache=True)
    method = Runtime.get().load_program(pte).load_method("forward")
    caches = [torch.randn(cfg.cache_shape) for _ in range(2 * cfg.layers)]
    before = [c.clone() for c in caches]
    with torch.no_grad(), pytest.raises(IndexError):
        CallerCacheDecoder(cfg).eval()(torch.tensor([[token]]), torch.tensor([0]), *[c.clone() for c in caches])
    with pytest.raises(
        DelegateError, match=rf"embedding: index {token} at position 0 is out of range for dimension 0 of size 64"
    ):
        method([torch.tensor([[token]]), torch.tensor([0]), *caches])
    for mine, old in zip(caches, before, strict=True):
        assert torch.equal(mine, old)
    # The method still works afterwards, and matches eager.
    model = CallerCacheDecoder(cfg).eval()
    eager = [c.clone() for c in caches]
    tokens, pos = case.step_inputs(0)
    out = method([tokens, pos, *caches])[-1]  # the mutated caches come first
    with torch.no_grad():
        expected = model(tokens, pos, *eager)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(caches, eager, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
