"""Before a call runs: every tensor it reads or writes in caller memory still has the
storage its shape needs, and no tensor it writes requires grad in grad mode (as
eager PyTorch refuses). Either failure is a ValueError with nothing run or written."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from writeback_pybind_runtime import Method, _pte

from tests.pybind_runtime.conftest import Lower
from tests.pybind_runtime.doubler import DoublerPartitioner

Load = Callable[[bytes], Method]


class Accumulate(torch.nn.Module):
    """``cache += x``; returns ``cache * 2``. Outputs: ``[new cache, cache * 2]``."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(x)
        return cache * 2


class ReturnsInput(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x + 1


def _accumulate(lower: Lower, load: Load, planned: bool = False) -> Method:
    return load(
        lower(Accumulate(), (torch.zeros(2, 3), torch.zeros(2, 3)), planned_inputs=planned, planned_outputs=False)
    )


X = torch.arange(6.0).view(2, 3)


def test_freed_storage_of_a_bound_output_is_refused_before_anything_runs(lower: Lower, load: Load) -> None:
    method = _accumulate(lower, load)
    bound, cache = torch.zeros(2, 3), torch.ones(2, 3)
    method.set_output(bound, 1)
    bound.untyped_storage().resize_(0)
    with pytest.raises(
        ValueError,
        match=r"cannot write output 1 of method 'forward' .* needs 24 bytes of storage but its storage holds 0 "
        r".*nothing was run or written.*set_output\(tensor, 1\).*set_output\(None, 1\)",
    ):
        method([X, cache])
    assert cache.tolist() == [[1.0] * 3] * 2  # the method did not run: no accumulation
    fresh = torch.zeros(2, 3)
    method.set_output(fresh, 1)
    _, doubled = method([X, cache])
    assert doubled is fresh
    torch.testing.assert_close(fresh, (X + 1) * 2)
    torch.testing.assert_close(cache, X + 1)


def test_binding_a_tensor_whose_storage_is_shrunk_is_refused(lower: Lower, load: Load) -> None:
    method = _accumulate(lower, load)
    short = torch.zeros(2, 3)
    short.untyped_storage().resize_(8)  # two floats of six
    with pytest.raises(ValueError, match=r"cannot bind output 1 .* needs 24 bytes of storage but its storage holds 8"):
        method.set_output(short, 1)
    assert not method.metadata.outputs[1].bound


def test_storage_offset_counts_in_the_bytes_a_bound_view_needs(lower: Lower, load: Load) -> None:
    method = _accumulate(lower, load)
    base = torch.zeros(8)
    view = base[2:].view(2, 3)  # storage offset 2: needs 8 + 24 bytes of 32
    method.set_output(view, 1)
    base.untyped_storage().resize_(28)
    with pytest.raises(ValueError, match=r"needs 32 bytes of storage but its storage holds 28"):
        method([X, torch.zeros(2, 3)])


def test_freed_storage_of_an_unplanned_input_is_refused_before_anything_runs(lower: Lower, load: Load) -> None:
    method = _accumulate(lower, load)
    x, cache = X.clone(), torch.ones(2, 3)
    x.untyped_storage().resize_(0)
    with pytest.raises(
        ValueError, match=r"input 0 of method 'forward': .* needs 24 bytes of storage but its storage holds 0"
    ):
        method([x, cache])
    # Freed after set_inputs: execute refuses too.
    x = X.clone()
    method.set_inputs([x, cache])
    x.untyped_storage().resize_(0)
    with pytest.raises(
        ValueError,
        match=r"input 0 of method 'forward': .* needs 24 bytes .* holds 0 .*nothing was run or written.*set_inputs",
    ):
        method.execute()
    assert cache.tolist() == [[1.0] * 3] * 2


@pytest.mark.parametrize("planned", [True, False], ids=["planned_copied_back", "unplanned_in_place"])
def test_freed_storage_of_a_mutated_input_after_set_inputs_is_refused(lower: Lower, load: Load, planned: bool) -> None:
    method = _accumulate(lower, load, planned=planned)
    cache = torch.ones(2, 3)
    method.set_inputs([X, cache])
    cache.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"input 1 of method 'forward': .* needs 24 bytes .* holds 0"):
        method.execute()
    with pytest.raises(ValueError, match=r"has no outputs"):
        method.get_outputs()


def test_input_whose_memory_moved_after_set_inputs_is_refused(lower: Lower, load: Load) -> None:
    method = _accumulate(lower, load)
    cache = torch.ones(2, 3)
    method.set_inputs([X, cache])
    cache.set_(torch.full((2, 3), 5.0).untyped_storage(), 0, (2, 3), (3, 1))  # old storage freed
    with pytest.raises(ValueError, match=r"input 1 of method 'forward': the tensor's memory moved .*set_inputs"):
        method.execute()
    assert cache.tolist() == [[5.0] * 3] * 2
    method.set_inputs([X, cache])
    method.execute()
    torch.testing.assert_close(cache, X + 5)


def test_requires_grad_leaf_bound_output_is_refused_like_eager(lower: Lower, load: Load) -> None:
    method = _accumulate(lower, load)
    leaf = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"out=\.\.\. arguments don't support automatic differentiation"):
        torch.mul(X, 2, out=leaf)  # what eager PyTorch says
    with pytest.raises(ValueError, match=r"cannot bind output 1 .*leaf that requires grad.*detach\(\).*no_grad"):
        method.set_output(leaf, 1)
    assert not method.metadata.outputs[1].bound and leaf.detach().tolist() == [[0.0] * 3] * 2
    # Made to require grad after binding: the call refuses, writes nothing.
    bound, cache = torch.zeros(2, 3), torch.ones(2, 3)
    method.set_output(bound, 1)
    bound.requires_grad_(True)
    with pytest.raises(ValueError, match=r"cannot write output 1 .*leaf that requires grad"):
        method([X, cache])
    assert bound.detach().tolist() == [[0.0] * 3] * 2 and cache.tolist() == [[1.0] * 3] * 2


def test_bound_output_requiring_grad_is_written_under_no_grad_like_eager(lower: Lower, load: Load) -> None:
    method = _accumulate(lower, load)
    leaf, eager = torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3, requires_grad=True)
    with torch.no_grad():
        torch.mul(X, 2, out=eager)  # eager allows out= under no_grad
        method.set_output(leaf, 1)
        method([X, torch.zeros(2, 3)])
    torch.testing.assert_close(leaf.detach(), eager.detach())


@pytest.mark.parametrize("planned", [True, False], ids=["planned_copied_back", "unplanned_in_place"])
def test_requires_grad_leaf_mutated_input_is_refused_before_anything_is_written(
    lower: Lower, load: Load, planned: bool
) -> None:
    method = _accumulate(lower, load, planned=planned)
    cache = torch.ones(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"a leaf Variable that requires grad"):
        cache.add_(X)  # what eager PyTorch says
    bound = torch.zeros(2, 3)
    method.set_output(bound, 1)
    with pytest.raises(
        ValueError, match=r"input 1 of method 'forward' is written by the method .*leaf that requires grad"
    ):
        method([X, cache])
    with pytest.raises(ValueError, match=r"input 1 .*leaf that requires grad"):
        method.set_inputs([X, cache])
    assert cache.detach().tolist() == [[1.0] * 3] * 2 and bound.tolist() == [[0.0] * 3] * 2
    # Made to require grad between set_inputs and execute: refused too.
    plain = torch.ones(2, 3)
    method.set_inputs([X, plain])
    plain.requires_grad_(True)
    with pytest.raises(ValueError, match=r"input 1 .*leaf that requires grad"):
        method.execute()
    assert plain.detach().tolist() == [[1.0] * 3] * 2 and bound.tolist() == [[0.0] * 3] * 2
    # Detached (same memory), it is written as eager writes under no_grad.
    method([X, cache.detach()])
    torch.testing.assert_close(cache.detach(), X + 1)


def test_requires_grad_non_leaf_mutated_input_is_refused(lower: Lower, load: Load) -> None:
    method = _accumulate(lower, load)
    cache = torch.ones(2, 3, requires_grad=True) * 1
    with pytest.raises(ValueError, match=r"input 1 .*requires grad, and this runtime records no autograd history"):
        method([X, cache])
    assert cache.detach().tolist() == [[1.0] * 3] * 2


def test_inputs_requiring_grad_that_are_only_read_or_returned_are_accepted(lower: Lower, load: Load) -> None:
    accumulate = _accumulate(lower, load)
    x = X.clone().requires_grad_(True)
    cache = torch.zeros(2, 3)
    accumulate([x, cache])  # x is only read
    torch.testing.assert_close(cache, X)
    returns_input = load(lower(ReturnsInput(), (torch.zeros(2),), planned_inputs=False, planned_outputs=False))
    leaf = torch.tensor([1.0, 2.0], requires_grad=True)
    same, plus = returns_input([leaf])
    assert same.tolist() == [1.0, 2.0] and plus.tolist() == [2.0, 3.0]


class WriteRow(torch.nn.Module):
    def forward(self, row: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, row)
        return cache.sum(0)


class SliceAssign(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache[0:1] = x
        return cache * 2


class ReturnsAndDoubles(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x + x) + (y + y)


@pytest.mark.parametrize(
    ("module", "args", "written"),
    [
        (Accumulate(), (torch.zeros(2, 3), torch.zeros(2, 3)), (False, True)),
        (ReturnsInput(), (torch.zeros(2),), (False,)),
        (WriteRow(), (torch.ones(1, 3), torch.tensor([0]), torch.zeros(2, 3)), (False, False, True)),
        (SliceAssign(), (torch.ones(1, 3), torch.zeros(2, 3)), (False, True)),
    ],
    ids=["add_", "returned_as_is", "index_copy_", "slice_assign"],
)
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_written_inputs_are_the_ones_eager_mutates(
    lower: Lower, module: torch.nn.Module, args: tuple[torch.Tensor, ...], written: tuple[bool, ...], planned: bool
) -> None:
    pte = lower(module, args, planned_inputs=planned, planned_outputs=planned)
    assert _pte.written_inputs(pte, "forward") == written


def test_an_input_returned_and_handed_to_a_delegate_counts_as_written(lower: Lower) -> None:
    """A delegate may write an input in place (writeback's in-place delegates do, for
    an input the method returns); the .pte does not say which, so such an input is
    treated as written. One only handed to a delegate, not returned, is read."""
    pte = lower(ReturnsAndDoubles(), (torch.zeros(2), torch.zeros(2)), partitioners=[DoublerPartitioner()])
    assert _pte.written_inputs(pte, "forward") == (True, False)
