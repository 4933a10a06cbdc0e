"""Hazards the seed's reviews named, each a test named after it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from writeback_pybind_runtime import Method

from tests.pybind_runtime.conftest import Lower

Load = Callable[[bytes], Method]


class ReturnsInput(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x + 1


class Accumulate(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(x)
        return cache * 2


@pytest.fixture
def returns_input(lower: Lower, load: Load) -> Method:
    return load(lower(ReturnsInput(), (torch.zeros(1, 3),), planned_inputs=False, planned_outputs=False))


def test_grad_tensors_and_parameters_come_back_detached_not_as_themselves(returns_input: Method) -> None:
    leaf = torch.ones(1, 3, requires_grad=True)
    parameter = torch.nn.Parameter(torch.ones(1, 3))
    for tensor in (leaf, parameter):
        same, _ = returns_input([tensor], clone_outputs=False)
        assert same is not tensor and not same.requires_grad
        assert same.data_ptr() == tensor.data_ptr()
        same.add_(1)  # allowed: a detached alias, not a leaf that requires grad
        assert tensor.detach().tolist() == [[2.0, 2.0, 2.0]]


def test_which_object_comes_back_does_not_depend_on_strides(returns_input: Method) -> None:
    canonical = torch.ones(1, 3)
    size_one_strides = torch.ones(3, 1).t()  # contiguous, strides (1, 1)
    for tensor in (canonical, size_one_strides):
        same, _ = returns_input([tensor], clone_outputs=False)
        assert same is not tensor and same.data_ptr() == tensor.data_ptr()
        assert same.shape == (1, 3) and same.stride() == (3, 1)


def test_runtime_does_not_retain_previous_inputs_or_outputs(returns_input: Method) -> None:
    first = torch.ones(1, 3)
    outputs = returns_input([first], clone_outputs=False)
    watched = [weakref.ref(first), *(weakref.ref(o) for o in outputs)]
    del first, outputs
    returns_input([torch.zeros(1, 3)], clone_outputs=False)
    gc.collect()
    assert [w() for w in watched] == [None, None, None]


def test_failed_set_inputs_then_full_set_binds_the_new_cache(lower: Lower, load: Load) -> None:
    """After a failed set_inputs, the output that is the mutated input is the *new* cache."""
    method = load(lower(Accumulate(), (torch.zeros(2), torch.zeros(2)), planned_inputs=False, planned_outputs=False))
    old_cache, new_cache = torch.zeros(2), torch.zeros(2)
    method([torch.ones(2), old_cache])
    with pytest.raises(ValueError, match=r"input 1"):
        method.set_inputs([torch.ones(2), torch.zeros(3, 3)])
    mutated, doubled = method([torch.ones(2), new_cache], clone_outputs=False)
    assert mutated.data_ptr() == new_cache.data_ptr()
    assert new_cache.tolist() == [1.0, 1.0] and old_cache.tolist() == [1.0, 1.0]
    assert doubled.tolist() == [2.0, 2.0]


def test_overlapping_bindings_do_not_write_the_same_memory(lower: Lower, load: Load) -> None:
    class Two(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x * 3

    method = load(lower(Two(), (torch.zeros(4),), planned_outputs=False))
    shared = torch.zeros(4)
    method.set_output(shared, 0)
    with pytest.raises(ValueError, match=r"shares memory with the tensor bound to output 0"):
        method.set_output(shared, 1)
    a, b = method([torch.ones(4)])
    assert a is shared and a.tolist() == [2.0] * 4 and b.tolist() == [3.0] * 4


def test_binding_before_the_first_call_does_not_depend_on_call_order(lower: Lower, load: Load) -> None:
    """Upstream could only find outputs that are inputs after the first set_inputs."""
    method = load(lower(Accumulate(), (torch.zeros(2), torch.zeros(2)), planned_inputs=False, planned_outputs=False))
    assert [o.is_input for o in method.metadata.outputs] == [1, None]
    with pytest.raises(ValueError, match=r"is input 1"):
        method.set_output(torch.zeros(2), 0)
    bound = torch.zeros(2)
    method.set_output(bound, 1)  # the real output binds before any call
    with pytest.raises(ValueError, match=r"inputs have not been set"):
        method.execute()
    cache = torch.zeros(2)
    _, doubled = method([torch.ones(2), cache])
    assert doubled is bound and bound.tolist() == [2.0, 2.0] and cache.tolist() == [1.0, 1.0]
