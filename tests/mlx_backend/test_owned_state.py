"""Delegate-owned buffers: kept as MLX arrays in the delegate and updated by buffer donation
(no second buffer of the cache's size is ever allocated, so a one-slot write costs
O(update)), checked by calling the runtime delegate's ``init``/``execute`` directly on the
processed blob of a real lowering."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from executorch.exir.lowered_backend_module import LoweredBackendModule
from writeback_mlx_backend import MLXDelegate

from tests.mlx_backend.lowering import lower_mlx


class RowCache(torch.nn.Module):
    def __init__(self, rows: int = 8, width: int = 4) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(rows, width))

    def forward(self, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, row)
        return self.cache.sum(0)


def _lowered_blob(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> bytes:
    lowered = lower_mlx(module, args)
    assert lowered.only_delegate_runs()
    modules = [
        m for m in lowered.program.exported_program().graph_module.children() if isinstance(m, LoweredBackendModule)
    ]
    assert len(modules) == 1
    return bytes(modules[0].processed_bytes)


def test_owned_buffer_is_updated_by_donation_without_a_second_buffer() -> None:
    rows, width = 1024, 1024  # a 4 MiB cache, far above any other allocation of a step
    blob = _lowered_blob(RowCache(rows, width), (torch.tensor([0]), torch.ones(1, width)))
    delegate = MLXDelegate()
    handle = delegate.init(blob, {})
    (state_name,) = handle.state
    eager = RowCache(rows, width)
    for step in range(4):
        pos, row = torch.tensor([step * 7]), torch.full((1, width), step + 1.0)
        out = torch.empty(width)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        delegate.execute(handle, [pos, row, out])
        grown = mx.get_peak_memory() - before
        assert grown < rows * width * 4 // 2, f"step {step} allocated {grown} bytes"
        with torch.no_grad():
            expected = eager(pos, row)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(torch.from_numpy(np.array(handle.state[state_name])), eager.cache)
    assert list(delegate.copied_input_bytes) == [8, width * 4] * 4
    assert delegate.copied_input_bytes_total == (8 + width * 4) * 4


def test_owned_buffer_is_unchanged_when_an_index_is_rejected() -> None:
    delegate = MLXDelegate()
    handle = delegate.init(_lowered_blob(RowCache(), (torch.tensor([0]), torch.ones(1, 4))), {})
    delegate.execute(handle, [torch.tensor([2]), torch.ones(1, 4), torch.empty(4)])
    before = np.array(next(iter(handle.state.values())))
    with pytest.raises(IndexError, match="negative indices are rejected"):
        delegate.execute(handle, [torch.tensor([-3]), torch.ones(1, 4), torch.empty(4)])
    np.testing.assert_array_equal(np.array(next(iter(handle.state.values()))), before)


def test_unknown_compile_spec_is_refused_by_name() -> None:
    """A program from a newer pipeline must not run with behaviour this runtime lacks."""
    blob = _lowered_blob(RowCache(), (torch.tensor([0]), torch.ones(1, 4)))
    with pytest.raises(ValueError, match=r"writeback\.future_feature.*upgrade"):
        MLXDelegate().init(blob, {"writeback.future_feature": b"1"})


def test_blob_of_another_version_is_refused() -> None:
    blob = bytearray(_lowered_blob(RowCache(), (torch.tensor([0]), torch.ones(1, 4))))
    blob[:8] = b"NOTMLX\x00\x00"
    with pytest.raises(ValueError, match=r"field magic .*not an MLX delegate blob"):
        MLXDelegate().init(bytes(blob), {})


class ReturnsItsBuffer(torch.nn.Module):
    """A program that returns the buffer it mutates (found by core's fuzzer).

    The buffer is overwritten first, so no step reads its initial value: the
    pybind-runtime leaves a program-planned mutable buffer uninitialized.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s0", torch.zeros(4, 3))

    def forward(self, idx: torch.Tensor, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        self.s0.copy_(base)
        self.s0.index_copy_(0, idx, x)
        return self.s0


def test_buffer_the_program_also_returns_stays_a_program_buffer_and_matches_eager() -> None:
    example = (torch.tensor([1]), torch.ones(1, 3), torch.zeros(4, 3))
    lowered = lower_mlx(ReturnsItsBuffer(), example)
    method = lowered.method()
    eager = ReturnsItsBuffer()
    for step in range(3):
        idx, x = torch.tensor([step]), torch.full((1, 3), float(step))
        base = torch.arange(12.0).reshape(4, 3) * step
        outputs = method.execute([idx, x, base])
        with torch.no_grad():
            expected = eager(idx, x, base)
        torch.testing.assert_close(outputs[-1], expected)


def test_copy_record_stays_bounded_over_a_long_decode_while_the_total_counts_every_copy() -> None:
    """A long decode loop must not grow the delegate's memory: only the latest copies are kept."""
    from writeback_mlx_backend.mlx_delegate import COPY_HISTORY

    delegate = MLXDelegate()
    handle = delegate.init(_lowered_blob(RowCache(), (torch.tensor([0]), torch.ones(1, 4))), {})
    calls = COPY_HISTORY  # two copies (position 8 B, row 16 B) per call: twice the history
    for step in range(calls):
        delegate.execute(handle, [torch.tensor([step % 8]), torch.ones(1, 4), torch.empty(4)])
    assert len(delegate.copied_input_bytes) == COPY_HISTORY
    assert delegate.copied_input_bytes_total == calls * (8 + 16)
