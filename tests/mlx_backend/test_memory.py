"""``empty``/``lookup``: which tensors the delegate reads in place (the MLX array itself)."""

from __future__ import annotations

import numpy as np
import torch
from writeback_mlx_backend import empty
from writeback_mlx_backend.allocations import lookup


def test_the_tensor_empty_returned_is_found_and_shares_memory_both_ways() -> None:
    cache = empty((3, 4))
    array = lookup(cache)
    assert array is not None and tuple(array.shape) == (3, 4)
    cache[1, 2] = 7.0
    assert float(np.asarray(array)[1, 2]) == 7.0


def test_a_reshaped_view_of_the_whole_allocation_is_found_with_its_own_shape() -> None:
    cache = empty((3, 4))
    array = lookup(cache.view(2, 6))
    assert array is not None and tuple(array.shape) == (2, 6)


def test_part_of_an_allocation_or_another_dtype_or_a_plain_tensor_is_not_found() -> None:
    cache = empty((3, 4))
    assert lookup(cache[:2]) is None  # same start, fewer bytes: a copy, never a partial alias
    assert lookup(cache[:, :2]) is None  # not contiguous
    assert lookup(cache.view(torch.int32)) is None  # same bytes read as another dtype
    assert lookup(torch.zeros(3, 4)) is None
