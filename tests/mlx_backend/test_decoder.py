"""The built-in decoder lowered whole to MLX, written to ``.pte`` and run for 16 decode
steps through the pybind-runtime: logits and caches equal eager PyTorch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from writeback.zoo import DecoderConfig, decoder_case

from tests.mlx_backend.lowering import lower_mlx

STEPS = 16
# The decoder test_compiled.py runs (the same program: a worker lowers it once, lowering.py).
CONFIG = DecoderConfig(vocab=32, dim=64, heads=4, max_seq=16, layers=2, hidden=128)
# With the caches the caller's: the decoder test_caller_writes.py runs.
CALLER_CONFIG = dataclasses.replace(CONFIG, max_seq=64)


def test_decoder_with_delegate_owned_cache_matches_eager() -> None:
    case = decoder_case(CONFIG)
    lowered = lower_mlx(case.build(), case.example_args(0))
    assert lowered.only_delegate_runs()
    assert {d.accepted for d in lowered.decisions} == {True}
    assert len(lowered.decisions) == 2 * CONFIG.layers
    method = lowered.method()
    model = case.build().eval()
    for step in range(STEPS):
        inputs = case.step_inputs(step)
        (logits,) = method.execute(list(inputs))
        with torch.no_grad():
            expected = model(*inputs)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    # The delegate owns the caches: nothing was copied into MLX but the step inputs.
    assert max(lowered.delegate().copied_input_bytes) <= 8


@pytest.mark.parametrize("allocator", [False, True], ids=["torch_cache", "mlx_allocated_cache"])
def test_decoder_with_caller_owned_cache_matches_eager(allocator: bool) -> None:
    from writeback_mlx_backend import empty

    case = decoder_case(CALLER_CONFIG, caller_cache=True)
    lowered = lower_mlx(case.build(), case.example_args(0), planned_inputs=not allocator)
    assert lowered.only_delegate_runs()
    assert lowered.write_backs() == []
    method = lowered.method()
    model = case.build().eval()
    eager_state = case.make_state()
    state = tuple(empty(s.shape) for s in eager_state) if allocator else case.make_state()
    for step in range(STEPS):
        inputs = case.step_inputs(step)
        outputs = method.execute([*inputs, *state])
        with torch.no_grad():
            expected = model(*inputs, *eager_state)
        torch.testing.assert_close(outputs[-1], expected, rtol=1e-4, atol=1e-5)
        for mine, eager in zip(state, eager_state, strict=True):
            torch.testing.assert_close(mine, eager, rtol=1e-4, atol=1e-5)
    cache_bytes = eager_state[0].numel() * 4
    copied = lowered.delegate().copied_input_bytes
    assert (cache_bytes in copied) is not allocator
