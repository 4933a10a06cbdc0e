"""A list value of a ``.pte`` whose item names a value of another kind is refused at
``load_method``, before ExecuTorch aborts the process on it.

ExecuTorch 1.5.1 reads an IntList's items as indices of Int values and calls
``toInt()`` on each when a kernel reads the list: an item naming a Double, a
Tensor or a value out of range killed the process with ``EValue is not an int``
(found by the blob fuzzer, ``writeback_testing.blobfuzz``). Each case runs in a
process of its own (a forked child of one loader process, see fork_loader.py) so
that a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from writeback_testing.ptefields import PlanField, plan_fields

from tests.pybind_runtime.conftest import to_pte
from tests.pybind_runtime.fork_loader import ForkLoader

_KINDS = {"Int": 2, "Double": 4, "Tensor": 5}


class SumOverDims(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=[0, 2])


@pytest.fixture(scope="module")
def fork_loader() -> Iterator[ForkLoader]:
    """Loads each case in a forked child of one process that imported torch and the
    runtime once (see fork_loader.py): a crash kills only that child."""
    loader = ForkLoader()
    yield loader
    loader.close()


def _load_and_call(fork_loader: ForkLoader, pte: Path) -> subprocess.CompletedProcess[str]:
    return fork_loader.load_and_call(pte, "sum")


@pytest.fixture(scope="module")
def sum_pte() -> bytes:
    """SumOverDims lowered once for the module (bytes: each test changes its own copy)."""
    return to_pte(SumOverDims(), (torch.ones(2, 3, 4),))


def _int_list_item(pte: bytes) -> tuple[int, int]:
    """The offset of the first IntList item of ``pte`` and the value index it holds."""
    item = next(f for f in plan_fields(pte) if ".IntList.items[" in f.path)
    return item.offset, item.read(pte)


def _value_kind(pte: bytes, index: int) -> tuple[int, int]:
    field = next(f for f in plan_fields(pte) if f.path == f"plan[0].values[{index}].kind")
    return field.offset, field.read(pte)


def test_unchanged_program_sums_as_eager(sum_pte: bytes, fork_loader: ForkLoader, tmp_path: Path) -> None:
    pte = tmp_path / "sum.pte"
    pte.write_bytes(sum_pte)
    done = _load_and_call(fork_loader, pte)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"ran {torch.ones(2, 3, 4).sum(dim=[0, 2]).tolist()}"


@pytest.mark.parametrize("kind", ["Double", "Tensor"])
def test_int_list_item_naming_a_value_of_another_kind_refused_at_load_no_crash(
    sum_pte: bytes, fork_loader: ForkLoader, tmp_path: Path, kind: str
) -> None:
    data = bytearray(sum_pte)
    _, index = _int_list_item(bytes(data))
    offset, was = _value_kind(bytes(data), index)
    assert was == _KINDS["Int"]
    data[offset] = _KINDS[kind]  # the Int the list names becomes a Double (or a Tensor)
    pte = tmp_path / "changed.pte"
    pte.write_bytes(bytes(data))
    done = _load_and_call(fork_loader, pte)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("ProgramError:"), done.stdout
    if kind == "Double":  # a Tensor table under an Int's name fails ExecuTorch's own verifier first
        assert f"names value {index} of kind {_KINDS[kind]}" in done.stdout, done.stdout


@pytest.mark.parametrize("item", [-1, 10_000, 2**40])
def test_int_list_item_out_of_range_refused_at_load_no_crash(
    sum_pte: bytes, fork_loader: ForkLoader, tmp_path: Path, item: int
) -> None:
    data = bytearray(sum_pte)
    offset, _ = _int_list_item(bytes(data))
    data[offset : offset + 8] = item.to_bytes(8, "little", signed=True)
    pte = tmp_path / "changed.pte"
    pte.write_bytes(bytes(data))
    done = _load_and_call(fork_loader, pte)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("ProgramError:"), done.stdout
    assert f"names value {item}, but the method has" in done.stdout, done.stdout


@pytest.fixture(scope="module")
def seed_pte() -> bytes:
    """The blob fuzzer's cache-write program as a ``.pte`` (writeback's lowering: it has an
    ``et_view``), where it found these crashes."""
    from writeback_testing.blobseeds import DEFAULT_PLUGINS, build_seeds, registry_of

    return next(s.blob for s in build_seeds(registry_of(DEFAULT_PLUGINS), "pte") if s.program == "cache-write")


def _kernel_calls(pte: bytes) -> list[tuple[int, str, list[int]]]:
    """``(instruction number, operator name, arguments)`` of each kernel call of chain 0."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    loaded = deserialize_pte_binary(pte)
    plan = getattr(loaded, "program", loaded).execution_plan[0]
    calls = []
    for number, instruction in enumerate(plan.chains[0].instructions):
        call = instruction.instr_args
        if hasattr(call, "op_index"):
            calls.append((number, plan.operators[call.op_index].name, list(call.args)))
    return calls


def _field(pte: bytes, path: str) -> PlanField:
    return next(f for f in plan_fields(pte) if f.path == path)


def _load_bytes_and_call(fork_loader: ForkLoader, data: bytes, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Loads ``data`` and calls it on the seed's inputs in a forked child (a crash kills the child)."""
    pte = tmp_path / "changed.pte"
    pte.write_bytes(data)
    return fork_loader.load_and_call(pte, "seed")


def test_unchanged_seed_program_runs(seed_pte: bytes, fork_loader: ForkLoader, tmp_path: Path) -> None:
    done = _load_bytes_and_call(fork_loader, seed_pte, tmp_path)
    assert done.stdout.strip() == "ran", done.stderr[-2000:]


@pytest.mark.parametrize("change", ["size names a tensor", "viewed tensor becomes null"])
def test_et_view_argument_of_the_wrong_kind_refused_at_load_no_crash(
    seed_pte: bytes, fork_loader: ForkLoader, tmp_path: Path, change: str
) -> None:
    """torch has no schema for ExecuTorch's ``et_view``, so its arguments went unchecked:
    a size naming a Tensor aborted the process in ``toIntList()``, a viewed value turned
    Null in ``toTensor()`` (found by the blob fuzzer)."""
    data = bytearray(seed_pte)
    number, _, args = next(c for c in _kernel_calls(seed_pte) if c[1] == "executorch_prim::et_view")
    if change == "size names a tensor":
        field = _field(seed_pte, f"plan[0].chains[0].instructions[{number}].KernelCall.args[1]")
        struct.pack_into(field.fmt, data, field.offset, args[0])
        refusal = f"passes value {args[0]} of kind 5 as argument 1 (List[int]) of executorch_prim::et_view"
    else:
        field = _field(seed_pte, f"plan[0].values[{args[0]}].kind")
        data[field.offset] = 1
        refusal = f"passes value {args[0]} of kind 1 as argument 0 (Tensor) of executorch_prim::et_view"
    done = _load_bytes_and_call(fork_loader, bytes(data), tmp_path)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("ProgramError:") and refusal in done.stdout, done.stdout


def test_partly_overlapping_planned_tensors_of_one_call_refused_at_load_no_memory_error(
    seed_pte: bytes, fork_loader: ForkLoader, tmp_path: Path
) -> None:
    """A planned tensor moved 8 bytes into another one that the same kernel call takes:
    ``index_put``'s memcpy then read and wrote the same bytes (AddressSanitizer:
    memcpy-param-overlap, found by the blob fuzzer); refused at load."""
    fields = {f.path: f for f in plan_fields(seed_pte)}
    low = "plan[0].values[{}].Tensor.allocation_info.memory_offset_low"
    _, name, args = next(c for c in _kernel_calls(seed_pte) if c[1] == "aten::index_put")
    planned = [a for a in dict.fromkeys(args) if low.format(a) in fields]
    first, moved = planned[0], planned[-1]
    data = bytearray(seed_pte)
    target = fields[low.format(moved)]
    struct.pack_into(target.fmt, data, target.offset, fields[low.format(first)].read(seed_pte) + 8)
    done = _load_bytes_and_call(fork_loader, bytes(data), tmp_path)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("ProgramError:") and "partly overlaps" in done.stdout, (name, done.stdout)


def test_et_view_of_itself_refused_at_load_no_segfault(
    seed_pte: bytes, fork_loader: ForkLoader, tmp_path: Path
) -> None:
    """``et_view(out, size, out)``: the view's value has no memory until the view gives it
    its source's, so it got a null pointer and the next kernel died with SIGSEGV."""
    number, _, args = next(c for c in _kernel_calls(seed_pte) if c[1] == "executorch_prim::et_view")
    data = bytearray(seed_pte)
    field = _field(seed_pte, f"plan[0].chains[0].instructions[{number}].KernelCall.args[0]")
    struct.pack_into(field.fmt, data, field.offset, args[2])
    done = _load_bytes_and_call(fork_loader, bytes(data), tmp_path)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("ProgramError:") and f"views value {args[2]} as itself" in done.stdout, done.stdout


@pytest.mark.parametrize("code", [12, 13, 14, 9])  # QInt8, QUInt8, QInt32, ComplexFloat
def test_tensor_of_a_dtype_no_kernel_takes_refused_at_load_no_abort(
    seed_pte: bytes, fork_loader: ForkLoader, tmp_path: Path, code: int
) -> None:
    """A float tensor's dtype changed to a quantized one: promoteTypes() aborted the process."""
    fields = [f for f in plan_fields(seed_pte) if f.path.endswith(".Tensor.scalar_type") and f.read(seed_pte) == 6]
    data = bytearray(seed_pte)
    for field in fields:
        data[field.offset] = code
    done = _load_bytes_and_call(fork_loader, bytes(data), tmp_path)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("ProgramError:") and f"dtype code {code}" in done.stdout, done.stdout
