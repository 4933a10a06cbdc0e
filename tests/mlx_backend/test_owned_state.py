"""Delegate-owned buffers: kept as MLX arrays in the delegate and updated by buffer donation
(the same memory every step, so a one-slot write costs O(update)), checked by calling the
runtime delegate's ``init``/``execute`` directly on the processed blob of a real lowering."""

from __future__ import annotations

import numpy as np
import torch
from executorch.exir.lowered_backend_module import LoweredBackendModule

from mlx_backend.lowering import lower_mlx
from writeback_mlx_backend import MLXDelegate


class RowCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, row)
        return self.cache.sum(0)


def _address(array: object) -> int:
    return int(np.asarray(array).__array_interface__["data"][0])


def test_owned_buffer_is_updated_in_its_own_memory_by_donation() -> None:
    lowered = lower_mlx(RowCache(), (torch.tensor([0]), torch.ones(1, 4)))
    assert lowered.only_delegate_runs()
    modules = [m for m in lowered.program.exported_program().graph_module.children()
               if isinstance(m, LoweredBackendModule)]
    assert len(modules) == 1
    delegate = MLXDelegate()
    handle = delegate.init(modules[0].processed_bytes, {})
    (state_name,) = handle.state
    address = _address(handle.state[state_name])
    eager = RowCache()
    for step in range(5):
        pos, row = torch.tensor([step]), torch.full((1, 4), step + 1.0)
        out = torch.empty(4)
        delegate.execute(handle, [pos, row, out])
        with torch.no_grad():
            expected = eager(pos, row)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(torch.from_numpy(np.array(handle.state[state_name])),
                                   eager.cache)
        assert _address(handle.state[state_name]) == address
    assert delegate.copied_input_bytes == [8, 16] * 5


def test_owned_buffer_is_unchanged_when_an_index_is_rejected() -> None:
    lowered = lower_mlx(RowCache(), (torch.tensor([0]), torch.ones(1, 4)))
    module = next(m for m in lowered.program.exported_program().graph_module.children()
                  if isinstance(m, LoweredBackendModule))
    delegate = MLXDelegate()
    handle = delegate.init(module.processed_bytes, {})
    delegate.execute(handle, [torch.tensor([2]), torch.ones(1, 4), torch.empty(4)])
    before = np.array(next(iter(handle.state.values())))
    try:
        delegate.execute(handle, [torch.tensor([-3]), torch.ones(1, 4), torch.empty(4)])
    except IndexError as error:
        assert "negative indices are rejected" in str(error)
    else:
        raise AssertionError("a negative index_copy index was accepted")
    np.testing.assert_array_equal(np.array(next(iter(handle.state.values()))), before)
