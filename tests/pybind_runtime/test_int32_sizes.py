"""ExecuTorch holds tensor sizes and strides as 32-bit ints: a caller tensor whose shape
does not fit them is refused by name, never narrowed into another shape.

Before, ``import_tensor`` cast each 64-bit DLPack size to ``int32_t`` and computed
``int32_t`` strides: an input of shape ``(0, 2**32 + 3)`` ran as shape ``(0, 3)``
(a silent wrong answer: eager's ``x + 1`` has shape ``(0, 4294967299)``), and a
shape whose contiguous strides pass 2**31 overflowed them. A Method now compares every dim
with the largest the method declares before anything else, so these tensors are refused
there, by name, before the 32-bit checks; the refusal must still name the input and the dim.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from writeback_pybind_runtime import Method

from tests.pybind_runtime.conftest import Lower

_INT32_MAX = 2**31 - 1


class AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_size_over_int32_refused_not_narrowed_no_silent_wrong_shape(
    lower: Lower, load: Callable[[bytes], Method], planned: bool
) -> None:
    method = load(lower(AddOne(), (torch.zeros(0, 3),), planned_inputs=planned, planned_outputs=False))
    huge = torch.zeros(0, 2**32 + 3)  # no elements, so no memory: eager answers with this shape
    assert (huge + 1).shape == (0, 2**32 + 3)
    with pytest.raises(ValueError, match=r"input 0 of method .forward.: dimension 1 is 4294967299, more than the 3"):
        method([huge])
    # The method still runs with a tensor of the shape it was exported with.
    assert method([torch.zeros(0, 3)])[0].shape == (0, 3)


def test_size_just_over_int32_in_set_output_refused(lower: Lower, load: Callable[[bytes], Method]) -> None:
    method = load(lower(AddOne(), (torch.zeros(0, 3),), planned_outputs=False))
    with pytest.raises(ValueError, match=r"dimension 1 has size 2147483648"):
        method.set_output(torch.zeros(0, _INT32_MAX + 1), 0)


def test_strides_over_int32_refused_before_any_copy_no_crash(lower: Lower, load: Callable[[bytes], Method]) -> None:
    """A tensor with elements whose contiguous strides need more than 32 bits: refused
    before the runtime makes it contiguous (which would allocate its 8 GiB)."""
    method = load(lower(AddOne(), (torch.zeros(2, 3, 4),), planned_outputs=False))
    # Every size fits 32 bits; the first dim's contiguous stride is 2**32.
    wide = torch.zeros(1, 1, 1, dtype=torch.bool).expand(2, 2**16, 2**16)
    with pytest.raises(ValueError, match=r"input 0 of method .forward.: dimension 1 is 65536, more than the 3"):
        method([wide])


def test_zero_element_tensor_with_large_strides_still_runs_as_eager(
    lower: Lower, load: Callable[[bytes], Method]
) -> None:
    """No element is addressed, so strides past 32 bits are harmless: eager's answer."""
    shape = (0, 70000, 70000)
    method = load(lower(AddOne(), (torch.zeros(shape),), planned_outputs=False))
    (out,) = method([torch.zeros(shape)])
    assert out.shape == (torch.zeros(shape) + 1).shape
