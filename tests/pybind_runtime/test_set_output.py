"""``Method.set_output``: every case of the seed's test plan and review, plus unbinding."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from writeback_pybind_runtime import Method

from tests.pybind_runtime.conftest import Lower

Load = Callable[[bytes], Method]


class TwoOutputs(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


class Accumulate(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(x)
        return cache * 1


class Recurrent(torch.nn.Module):
    """``h' = h @ tanh(W + x)``: the state comes back as an output, not a mutation.

    The last kernel (``mm``) reads ``h`` while it writes ``h'``: if ``h'`` were
    written into ``h``'s memory the result would be wrong, not just stale.
    """

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(4, 4, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return h @ torch.tanh(self.weight + x)


@pytest.fixture
def two(lower: Lower, load: Load) -> Method:
    """``(2x, x + 1)`` for x of shape (2, 3), outputs not memory planned."""
    return load(lower(TwoOutputs(), (torch.zeros(2, 3),), planned_outputs=False))


X = torch.arange(6.0).view(2, 3)


def test_binding_writes_into_caller_tensor_uncloned(two: Method) -> None:
    bound = torch.empty(2, 3)
    two.set_output(bound, 0)
    doubled, plus = two([X])
    assert doubled is bound
    torch.testing.assert_close(bound, X * 2)
    torch.testing.assert_close(plus, X + 1)
    two([X + 10])  # later calls overwrite it
    torch.testing.assert_close(bound, (X + 10) * 2)
    assert two.metadata.outputs[0].bound and not two.metadata.outputs[1].bound


def test_rebinding_moves_writes_to_the_new_tensor(two: Method) -> None:
    first, second = torch.zeros(2, 3), torch.zeros(2, 3)
    two.set_output(first, 0)
    two([X])
    two.set_output(second, 0)
    (out, _) = two([X + 1])
    assert out is second
    torch.testing.assert_close(second, (X + 1) * 2)
    torch.testing.assert_close(first, X * 2)  # no longer written


def test_dynamic_output_smaller_than_bound_tensor_is_a_view_of_its_front(lower: Lower, load: Load) -> None:
    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    rows = torch.export.Dim("rows", min=1, max=8)
    pte = lower(Double(), (torch.zeros(8, 3),), planned_outputs=False, dynamic_shapes=({0: rows},))
    method = load(pte)
    bound = torch.full((8, 3), -1.0)
    method.set_output(bound, 0)
    x = torch.arange(15.0).view(5, 3)
    (out,) = method([x])
    assert out.shape == (5, 3) and out.data_ptr() == bound.data_ptr()
    torch.testing.assert_close(out, x * 2)
    assert bound.view(-1)[15:].tolist() == [-1.0] * 9
    (full,) = method([torch.ones(8, 3)])
    assert full is bound


def test_unbinding_with_none_returns_to_runtime_storage(two: Method) -> None:
    bound = torch.zeros(2, 3)
    two.set_output(bound, 0)
    two([X])
    two.set_output(None, 0)
    (out, _) = two([X + 5])
    assert out is not bound and out.data_ptr() != bound.data_ptr()
    torch.testing.assert_close(out, (X + 5) * 2)
    torch.testing.assert_close(bound, X * 2)  # untouched since unbinding
    assert not two.metadata.outputs[0].bound
    two.set_output(None, 0)  # unbinding an unbound output is a no-op


def test_uncloned_outputs_stay_valid_after_rebinding(two: Method) -> None:
    before = two([X], clone_outputs=False)[0]  # aliases the runtime's storage
    bound = torch.zeros(2, 3)
    two.set_output(bound, 0)
    two([X + 100])
    torch.testing.assert_close(before, X * 2)  # old storage kept alive and not rewritten
    rebound = torch.zeros(2, 3)
    two.set_output(rebound, 0)
    two.set_output(None, 0)
    del bound, rebound
    (after, _) = two([X + 7], clone_outputs=False)
    torch.testing.assert_close(after, (X + 7) * 2)
    torch.testing.assert_close(before, X * 2)  # unbinding gives fresh storage


def test_clone_outputs_true_clones_every_unbound_output(two: Method) -> None:
    first = two([X])
    second = two([X + 1])
    torch.testing.assert_close(first[0], X * 2)
    assert first[0].data_ptr() != second[0].data_ptr()
    uncloned = two([X], clone_outputs=False)
    again = two([X], clone_outputs=False)
    assert uncloned[0].data_ptr() == again[0].data_ptr()


def test_execute_without_inputs_after_binding_raises(two: Method) -> None:
    two.set_output(torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match=r"inputs have not been set"):
        two.execute()


def test_execute_without_inputs_raises_without_binding(two: Method) -> None:
    with pytest.raises(ValueError, match=r"inputs have not been set"):
        two.execute()


def test_failed_set_inputs_refuses_execute_until_a_full_set(two: Method) -> None:
    two([X])
    with pytest.raises(ValueError, match=r"input 0 .*expected dtype float32, got int64"):
        two.set_inputs([torch.zeros(2, 3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"inputs have not been set"):
        two.execute()
    with pytest.raises(ValueError, match=r"no outputs"):
        two.get_outputs()
    torch.testing.assert_close(two([X])[0], X * 2)


# --- rejections: ValueError naming expected and actual, nothing changed -------------------


def _assert_unchanged(two: Method) -> None:
    assert not any(o.bound for o in two.metadata.outputs)
    out = two([X])
    torch.testing.assert_close(out[0], X * 2)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(2, 3, dtype=torch.float64), "expected dtype float32, got float64"),
        (torch.zeros(2, 3, dtype=torch.int32), "expected dtype float32, got int32"),
        (torch.zeros(3, 2).t(), "not contiguous"),
        (torch.zeros(5), "needs 24 bytes.*has 20"),
        (torch.zeros(2, 3, device="meta"), "expected a CPU tensor, got a tensor on device meta"),
    ],
    ids=["float64", "int32", "non_contiguous", "too_small", "meta_device"],
)
def test_bad_tensor_is_rejected_naming_expected_and_actual(two: Method, tensor: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        two.set_output(tensor, 0)
    _assert_unchanged(two)


def test_larger_tensor_is_accepted(two: Method) -> None:
    bound = torch.zeros(10)
    two.set_output(bound, 0)
    (out, _) = two([X])
    assert out.shape == (2, 3) and out.data_ptr() == bound.data_ptr()
    torch.testing.assert_close(out, X * 2)


def test_tensor_sharing_memory_with_another_bound_output_is_rejected(two: Method) -> None:
    storage = torch.zeros(12)
    two.set_output(storage[:6], 0)
    with pytest.raises(ValueError, match=r"shares memory with the tensor bound to output 0"):
        two.set_output(storage[3:9], 1)
    assert not two.metadata.outputs[1].bound


def test_tensor_sharing_memory_with_an_input_is_rejected(two: Method) -> None:
    x = X.clone()
    two.set_inputs([x])
    with pytest.raises(ValueError, match=r"shares memory with input 0"):
        two.set_output(x, 0)
    _assert_unchanged(two)


def test_input_sharing_memory_with_a_bound_output_is_rejected_at_execute(lower: Lower, load: Load) -> None:
    method = load(lower(TwoOutputs(), (torch.zeros(2, 3),), planned_inputs=False, planned_outputs=False))
    bound = torch.zeros(2, 3)
    method.set_output(bound, 0)
    method.set_inputs([bound])
    with pytest.raises(ValueError, match=r"shares memory with input 0"):
        method.execute()
    assert bound.tolist() == [[0.0] * 3] * 2  # nothing written


def test_memory_planned_output_is_rejected(lower: Lower, load: Load) -> None:
    method = load(lower(TwoOutputs(), (torch.zeros(2, 3),)))
    with pytest.raises(ValueError, match=r"output 0 .*memory planned.*alloc_graph_output=False"):
        method.set_output(torch.zeros(2, 3), 0)


def test_output_returned_at_two_indices_is_rejected(lower: Lower, load: Load) -> None:
    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = x * 2
            return y, y

    method = load(lower(Twice(), (torch.zeros(3),), planned_outputs=False))
    assert method.metadata.outputs[0].repeats == (1,)
    with pytest.raises(ValueError, match=r"returned at outputs \[1\]"):
        method.set_output(torch.zeros(3), 0)
    a, b = method([torch.ones(3)])
    assert a.tolist() == b.tolist() == [2.0] * 3


def test_binding_the_output_that_is_a_mutated_input_is_refused_never_redirected(lower: Lower, load: Load) -> None:
    """Refused before any call too: the program says output 0 is input 1, no call order needed."""
    method = load(
        lower(Accumulate(), (torch.zeros(2, 3), torch.zeros(2, 3)), planned_inputs=False, planned_outputs=False)
    )
    decoy = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"output 0 .*is input 1"):
        method.set_output(decoy, 0)
    cache = torch.zeros(2, 3)
    method([torch.ones(2, 3), cache])
    with pytest.raises(ValueError, match=r"output 0 .*is input 1"):
        method.set_output(decoy, 0)
    method([torch.ones(2, 3), cache])
    assert cache.tolist() == [[2.0] * 3] * 2 and decoy.tolist() == [[0.0] * 3] * 2


def test_index_out_of_range_is_an_index_error(two: Method) -> None:
    with pytest.raises(IndexError, match=r"has 2 outputs; output 2"):
        two.set_output(torch.zeros(2, 3), 2)


def test_bound_tensor_resized_by_caller_is_rechecked_each_call(two: Method) -> None:
    bound = torch.zeros(2, 3)
    two.set_output(bound, 0)
    two([X])
    bound.resize_(64)  # moves its storage
    (out, _) = two([X])
    assert out.data_ptr() == bound.data_ptr()
    torch.testing.assert_close(bound[:6].view(2, 3), X * 2)
    bound.resize_(2)
    with pytest.raises(ValueError, match=r"needs 24 bytes.*has 8"):
        two([X])


# --- outputs fed back as inputs ---------------------------------------------------------


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_uncloned_output_fed_back_as_next_input(lower: Lower, load: Load, planned: bool) -> None:
    model = Recurrent().eval()
    method = load(
        lower(Recurrent(), (torch.zeros(4, 4), torch.zeros(1, 4)), planned_inputs=planned, planned_outputs=planned)
    )
    h, eager_h = torch.ones(1, 4), torch.ones(1, 4)
    for step in range(6):
        x = torch.full((4, 4), 0.1 * step)
        (h,) = method([x, h], clone_outputs=False)
        with torch.no_grad():
            eager_h = model(x, eager_h)
        torch.testing.assert_close(h, eager_h)


def test_bound_output_fed_back_as_input_is_refused(lower: Lower, load: Load) -> None:
    method = load(
        lower(Recurrent(), (torch.zeros(4, 4), torch.zeros(1, 4)), planned_inputs=False, planned_outputs=False)
    )
    state = torch.zeros(1, 4)
    method.set_output(state, 0)
    with pytest.raises(ValueError, match=r"shares memory with input 1"):
        method([torch.ones(4, 4), state])
