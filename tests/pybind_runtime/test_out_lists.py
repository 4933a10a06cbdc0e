"""Kernels that write a list of tensors load and run like eager (``chunk``, ``split`` and
``unbind`` all reach the runtime as ``split_with_sizes_copy.out``, whose ``out`` is a tensor
list), and a list that names an input counts as writing that input.

ExecuTorch's emitter appends an out variant's out arguments after its schema arguments,
whatever the schema returns: ``split_with_sizes_copy.out`` returns ``()`` yet its kernel
call carries its ``out`` list twice. Phi-3's and GLM's fused gate/up projection
(``chunk(2)``) meet it in every decoder layer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary
from executorch.exir.schema import KernelCall, TensorList
from writeback_pybind_runtime import ProgramError, _pte, _pte_operators

from .conftest import Lower, stock_method


class Splits(torch.nn.Module):
    """A cache updated from the halves of ``x``; outputs from its unbound rows and split parts."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gate, up = x.chunk(2, dim=-1)
        rows = torch.unbind(x.reshape(2, -1))
        head, tail = torch.split(x, [3, 5])
        quarters = torch.split(x, 2)
        cache.add_(gate * up)
        return cache * 2, rows[0] - rows[1], head.sum() + tail.sum(), quarters[3]


def _operators(pte: bytes) -> set[str]:
    plan = deserialize_pte_binary(pte).program.execution_plan[0]
    return {f"{op.name}.{op.overload}" for op in plan.operators}


def _list_writing_kernels(pte: bytes) -> list[tuple[str, KernelCall]]:
    plan = deserialize_pte_binary(pte).program.execution_plan[0]
    found = []
    for chain in plan.chains:
        for instruction in chain.instructions:
            call = instruction.instr_args
            if isinstance(call, KernelCall):
                op = plan.operators[call.op_index]
                if isinstance(plan.values[call.args[-1]].val, TensorList):
                    found.append((f"{op.name}.{op.overload}", call))
    return found


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_chunk_split_and_unbind_programs_load_and_match_eager(lower: Lower, load: Any, planned: bool) -> None:
    pte = lower(Splits(), (torch.randn(8), torch.zeros(4)), planned_inputs=planned, planned_outputs=planned)
    assert "aten::split_with_sizes_copy.out" in _operators(pte)
    method = load(pte)
    cache, expected_cache = torch.ones(4), torch.ones(4)
    for step in range(3):
        x = torch.arange(8, dtype=torch.float32) * (step + 1) - 3
        outputs = method([x, cache])
        expected = Splits()(x, expected_cache)
        torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0)
        # The first output is the mutated cache (exir returns mutated inputs first).
        assert len(outputs) == 1 + len(expected)
        for actual, wanted in zip(outputs[1:], expected, strict=True):
            torch.testing.assert_close(actual, wanted, rtol=0, atol=0)
    if not planned:
        return  # stock ExecuTorch mishandles unplanned mutated inputs (packages/pybind-runtime/README.md)
    # The stock runtime loads the same bytes and computes the same values.
    stock = stock_method(pte)
    x = torch.full((8,), 0.5)
    stock_outputs = stock.execute([x, torch.ones(4)])
    ours = load(pte)([x, torch.ones(4)])
    for a, b in zip(ours, stock_outputs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_split_into_planned_memory_writes_no_input(lower: Lower) -> None:
    pte = lower(Splits(), (torch.randn(8), torch.zeros(4)))
    assert _pte.written_inputs(pte, "forward") == (False, True)


def test_an_out_list_naming_an_input_counts_as_writing_that_input(lower: Lower, load: Any) -> None:
    """A crafted file whose split writes its ``out`` list over the input ``x``: the method
    writes ``x``, so the runtime must know (it refuses such an input that requires grad,
    changing nothing, as eager refuses an in-place write to a leaf that requires grad)."""
    pte = lower(Splits(), (torch.randn(8), torch.zeros(4)), planned_inputs=False, planned_outputs=False)
    file = deserialize_pte_binary(pte)
    plan = file.program.execution_plan[0]
    x_value = plan.inputs[0]
    _, call = next((n, c) for n, c in _list_writing_kernels(pte) if n == "aten::split_with_sizes_copy.out")
    # The call's out list (the schema's ``out``) and the emitter's appended copy of it.
    for index in (call.args[-2], call.args[-1]):
        items = plan.values[index].val.items
        plan.values[index].val.items = [x_value, *items[1:]]
    crafted = bytes(serialize_pte_binary(file))
    assert _pte.written_inputs(crafted, "forward") == (True, True)
    x = torch.arange(8, dtype=torch.float32).requires_grad_(True)
    before = x.detach().clone()
    cache = torch.ones(4)
    with pytest.raises((ValueError, ProgramError), match="requires grad"):
        load(crafted)([x, cache])
    assert torch.equal(x.detach(), before) and torch.equal(cache, torch.ones(4))


@pytest.mark.parametrize(
    ("name", "overload", "arguments"),
    [
        ("aten::split_with_sizes_copy", "out", 5),  # self, split_sizes, dim, out; out again
        ("aten::unbind_copy", "int_out", 4),  # self, dim, out; out again
        ("aten::add", "out", 5),  # self, other, alpha, out; the returned out
        ("aten::max", "dim_max", 6),  # self, dim, keepdim, max, max_values; both as one list
    ],
)
def test_a_kernel_call_takes_the_schema_arguments_then_the_out_arguments_once_more(
    name: str, overload: str, arguments: int
) -> None:
    signature = _pte_operators.kernel_signature(name, overload)
    assert signature is not None and len(signature) == arguments
    written = _pte_operators.written_positions(name, overload)
    assert written is not None and arguments - 1 in written


def test_an_out_list_of_the_wrong_kind_is_still_refused_naming_the_argument(lower: Lower, load: Any) -> None:
    pte = lower(Splits(), (torch.randn(8), torch.zeros(4)))
    file = deserialize_pte_binary(pte)
    plan = file.program.execution_plan[0]
    _, call = next((n, c) for n, c in _list_writing_kernels(pte) if n == "aten::split_with_sizes_copy.out")
    position = next(i for i, c in enumerate(plan.chains[0].instructions) if c.instr_args == call)
    bad = plan.chains[0].instructions[position].instr_args
    bad.args = [*bad.args[:-1], plan.inputs[0]]  # a tensor where the out list goes
    crafted = bytes(serialize_pte_binary(file))
    with pytest.raises(ProgramError, match=r"as argument 4 \(List\[Tensor\]\) of aten::split_with_sizes_copy.out"):
        load(crafted)
