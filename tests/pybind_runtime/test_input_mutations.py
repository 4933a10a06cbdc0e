"""Mutated inputs land in the caller's tensor; each stock ``executorch.runtime`` defect
listed in packages/pybind-runtime/README.md is shown on the same program, side by side
with this runtime."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from writeback.zoo import DecoderConfig, decoder_case
from writeback_pybind_runtime import Method

from tests.pybind_runtime.conftest import Lower, stock_method

Load = Callable[[bytes], Method]

# What a failing stock check asks for: the README lists the stock defects this file shows.
_FIXED_UPSTREAM = "stock defect fixed upstream? update packages/pybind-runtime/README.md"


class Accumulate(torch.nn.Module):
    """``cache += x`` (a user-input mutation), returning a reduction of it.

    exir returns the mutated input first: outputs are ``[new cache, total]``.
    """

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(x)
        return cache.sum(0, keepdim=True)


class WriteRow(torch.nn.Module):
    """A KV-cache-like row write with ``index_copy_`` at a position input."""

    def forward(self, row: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, row)
        return cache.sum(0)


def _eager_accumulate(steps: list[torch.Tensor]) -> torch.Tensor:
    cache = torch.zeros(2, 3)
    for x in steps:
        cache += x
    return cache


STEPS = [torch.full((2, 3), float(k + 1)) for k in range(3)]


@pytest.mark.parametrize("planned", [True, False], ids=["planned_copied_back", "unplanned_in_place"])
def test_mutated_input_lands_in_callers_tensor(lower: Lower, load: Load, planned: bool) -> None:
    method = load(
        lower(Accumulate(), (torch.ones(2, 3), torch.zeros(2, 3)), planned_inputs=planned, planned_outputs=planned)
    )
    cache = torch.zeros(2, 3)
    for k, x in enumerate(STEPS):
        new_cache, total = method([x, cache])
        expected = _eager_accumulate(STEPS[: k + 1])
        torch.testing.assert_close(cache, expected)
        torch.testing.assert_close(total, expected.sum(0, keepdim=True))
        torch.testing.assert_close(new_cache, expected)


def test_unplanned_mutated_input_is_written_in_place_without_copy(lower: Lower, load: Load) -> None:
    """The output that is the mutated input aliases the caller's storage (clone_outputs=False)."""
    method = load(
        lower(Accumulate(), (torch.ones(2, 3), torch.zeros(2, 3)), planned_inputs=False, planned_outputs=False)
    )
    assert method.metadata.outputs[0].is_input == 1
    cache = torch.zeros(2, 3)
    outputs = method([torch.ones(2, 3), cache], clone_outputs=False)
    assert outputs[0].data_ptr() == cache.data_ptr()
    assert outputs[0] is not cache and not outputs[0].requires_grad


def test_stock_runtime_does_not_update_planned_mutated_input(lower: Lower, load: Load) -> None:
    pte = lower(Accumulate(), (torch.ones(2, 3), torch.zeros(2, 3)))
    stock_cache, our_cache = torch.zeros(2, 3), torch.zeros(2, 3)
    stock_method(pte).execute([torch.ones(2, 3), stock_cache])
    load(pte)([torch.ones(2, 3), our_cache])
    assert torch.equal(stock_cache, torch.zeros(2, 3)), _FIXED_UPSTREAM
    assert torch.equal(our_cache, torch.ones(2, 3))


def test_stock_runtime_is_silently_wrong_with_unplanned_mutated_input(lower: Lower, load: Load) -> None:
    pte = lower(Accumulate(), (torch.ones(2, 3), torch.zeros(2, 3)), planned_inputs=False, planned_outputs=False)
    stock, ours = stock_method(pte), load(pte)
    stock_outputs, our_outputs = [], []
    for x in STEPS:
        # A fresh zero cache each call: the right total is x summed over rows.
        stock_outputs.append(stock.execute([x, torch.zeros(2, 3)])[-1])
        our_outputs.append(ours([x, torch.zeros(2, 3)])[-1])
    right = [x.sum(0, keepdim=True) for x in STEPS]
    for got, want in zip(our_outputs, right, strict=True):
        torch.testing.assert_close(got, want)
    # Stock ignores the caller's cache and accumulates in its own buffer.
    assert not torch.equal(stock_outputs[-1], right[-1]), _FIXED_UPSTREAM
    torch.testing.assert_close(stock_outputs[-1], _eager_accumulate(STEPS).sum(0, keepdim=True))


def test_stock_set_inputs_keeps_dangling_pointers_to_temporaries(lower: Lower, load: Load) -> None:
    """Stock reads freed memory when set_inputs got temporaries; here they are kept alive."""

    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    pte = lower(Scale(), (torch.ones(64),), planned_inputs=False)
    ours = load(pte)
    ours.set_inputs([torch.ones(64)])
    gc.collect()
    clobber = torch.full((64,), 100.0)  # would reuse the temporary's block if it had been freed
    ours.execute()
    assert ours.get_outputs()[0].tolist() == [3.0] * 64
    del clobber

    stock = stock_method(pte)._method
    temporary = torch.ones(64)
    address = temporary.data_ptr()
    stock.set_inputs((temporary,))
    del temporary
    clobber = torch.full((64,), 100.0)
    stock.execute()
    (stock_out,) = stock.get_outputs()
    if clobber.data_ptr() == address:
        # The freed block was reused: stock computed from the clobbering tensor.
        assert stock_out.tolist() == [300.0] * 64, _FIXED_UPSTREAM


def test_stock_runtime_has_no_set_output(lower: Lower, load: Load) -> None:
    pte = lower(Accumulate(), (torch.ones(2, 3), torch.zeros(2, 3)), planned_outputs=False)
    assert not hasattr(stock_method(pte), "set_output")
    assert not hasattr(stock_method(pte)._method, "set_output")
    assert callable(load(pte).set_output)


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_index_copy_cache_matches_eager_over_steps(lower: Lower, load: Load, planned: bool) -> None:
    args = (torch.zeros(1, 4), torch.tensor([0]), torch.zeros(5, 4))
    method = load(lower(WriteRow(), args, planned_inputs=planned, planned_outputs=planned))
    cache, eager_cache = torch.zeros(5, 4), torch.zeros(5, 4)
    for step in range(5):
        row, pos = torch.randn(1, 4), torch.tensor([step])
        out = method([row, pos, cache])[-1]
        want = WriteRow()(row, pos, eager_cache)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(cache, eager_cache)


@pytest.mark.parametrize("clone", [True, False], ids=["cloned", "uncloned"])
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_output_that_is_an_input_under_both_clone_settings(
    lower: Lower, load: Load, planned: bool, clone: bool
) -> None:
    """``return x, x + 1``: cloned by default (stock's behaviour), the caller's storage without."""

    class ReturnsInput(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x + 1

    method = load(lower(ReturnsInput(), (torch.zeros(3),), planned_inputs=planned, planned_outputs=planned))
    x = torch.tensor([1.0, 2.0, 3.0])
    same, plus = method([x], clone_outputs=clone)
    assert same.tolist() == [1.0, 2.0, 3.0] and plus.tolist() == [2.0, 3.0, 4.0]
    assert (same.data_ptr() == x.data_ptr()) is (not clone)
    same.add_(10)  # a clone is independent of the caller's tensor; an alias is not
    assert x.tolist() == ([1.0, 2.0, 3.0] if clone else [11.0, 12.0, 13.0])


def test_caller_cache_decoder_matches_eager(lower: Lower, load: Load) -> None:
    case = decoder_case(DecoderConfig(max_seq=8), caller_cache=True)
    model = case.build().eval()
    method = load(lower(case.build(), case.example_args(0), planned_inputs=False, planned_outputs=False))
    caches, eager_caches = case.make_state(), case.make_state()
    for step in range(4):
        inputs = case.step_inputs(step)
        logits = method([*inputs, *caches])[-1]
        with torch.no_grad():
            want = model(*inputs, *eager_caches)
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5)
        for got, expected in zip(caches, eager_caches, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
