"""The one checked helper for dims and indices agrees with eager PyTorch's own rule."""

from __future__ import annotations

import pytest
import torch
from writeback_core.ops import normalize_dim, normalize_index


@pytest.mark.parametrize("rank", [0, 1, 2, 4])
def test_every_dim_eager_accepts_is_the_axis_eager_uses_and_every_other_raises(rank: int) -> None:
    for dim in range(-rank - 2, rank + 2):
        try:
            eager_axis = torch.ones((2,) * rank).sum(dim=dim, keepdim=True).shape
        except IndexError:
            with pytest.raises(IndexError, match=rf"out of range .*but got {dim}\)"):
                normalize_dim(dim, rank)
            continue
        axis = normalize_dim(dim, rank)
        # summing over the axis the helper names leaves eager's shape
        ours = torch.ones((2,) * rank).sum(dim=axis, keepdim=True).shape if rank else eager_axis
        assert ours == eager_axis


def test_a_dim_read_from_a_file_that_is_not_an_int_is_refused_naming_what() -> None:
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="cache dim: a dim must be an int"):
            normalize_dim(bad, 3, what="cache dim")


@pytest.mark.parametrize("size", [1, 4])
def test_every_index_eager_accepts_reads_the_row_eager_reads_and_every_other_raises(size: int) -> None:
    t = torch.arange(size)
    for index in range(-size - 3, size + 3):
        try:
            eager = int(t[index])
        except IndexError:
            message = f"k row: index {index} is out of bounds for a dimension of size {size}"
            with pytest.raises(IndexError, match=message):
                normalize_index(index, size, what="k row")
            continue
        assert int(t[normalize_index(index, size)]) == eager
