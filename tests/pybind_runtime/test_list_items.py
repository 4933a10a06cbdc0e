"""A list value of a ``.pte`` whose item names a value of another kind is refused at
``load_method``, before ExecuTorch aborts the process on it.

ExecuTorch 1.5.1 reads an IntList's items as indices of Int values and calls
``toInt()`` on each when a kernel reads the list: an item naming a Double, a
Tensor or a value out of range killed the process with ``EValue is not an int``
(found by the blob fuzzer, ``writeback_testing.blobfuzz``). Each case runs in a
subprocess so that a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from writeback_testing.ptefields import plan_fields

from tests.pybind_runtime.conftest import Lower

_KINDS = {"Int": 2, "Double": 4, "Tensor": 5}


class SumOverDims(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=[0, 2])


def _load_and_call(pte: Path) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(
        f"""
        import torch
        from writeback_core.registry import load_registry
        from writeback_pybind_runtime import ProgramError, Runtime
        runtime = Runtime(load_registry(entry_points=False))
        try:
            method = runtime.load_program(open({str(pte)!r}, "rb").read()).load_method("forward")
            print("ran", method([torch.ones(2, 3, 4)])[0].tolist())
        except ProgramError as error:
            print("ProgramError:", error)
        """
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)


def _int_list_item(pte: bytes) -> tuple[int, int]:
    """The offset of the first IntList item of ``pte`` and the value index it holds."""
    item = next(f for f in plan_fields(pte) if ".IntList.items[" in f.path)
    return item.offset, item.read(pte)


def _value_kind(pte: bytes, index: int) -> tuple[int, int]:
    field = next(f for f in plan_fields(pte) if f.path == f"plan[0].values[{index}].kind")
    return field.offset, field.read(pte)


def test_unchanged_program_sums_as_eager(lower: Lower, tmp_path: Path) -> None:
    pte = tmp_path / "sum.pte"
    pte.write_bytes(lower(SumOverDims(), (torch.ones(2, 3, 4),)))
    done = _load_and_call(pte)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"ran {torch.ones(2, 3, 4).sum(dim=[0, 2]).tolist()}"


@pytest.mark.parametrize("kind", ["Double", "Tensor"])
def test_int_list_item_naming_a_value_of_another_kind_refused_at_load_no_crash(
    lower: Lower, tmp_path: Path, kind: str
) -> None:
    data = bytearray(lower(SumOverDims(), (torch.ones(2, 3, 4),)))
    _, index = _int_list_item(bytes(data))
    offset, was = _value_kind(bytes(data), index)
    assert was == _KINDS["Int"]
    data[offset] = _KINDS[kind]  # the Int the list names becomes a Double (or a Tensor)
    pte = tmp_path / "changed.pte"
    pte.write_bytes(bytes(data))
    done = _load_and_call(pte)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("ProgramError:"), done.stdout
    if kind == "Double":  # a Tensor table under an Int's name fails ExecuTorch's own verifier first
        assert f"names value {index} of kind {_KINDS[kind]}" in done.stdout, done.stdout


@pytest.mark.parametrize("item", [-1, 10_000, 2**40])
def test_int_list_item_out_of_range_refused_at_load_no_crash(lower: Lower, tmp_path: Path, item: int) -> None:
    data = bytearray(lower(SumOverDims(), (torch.ones(2, 3, 4),)))
    offset, _ = _int_list_item(bytes(data))
    data[offset : offset + 8] = item.to_bytes(8, "little", signed=True)
    pte = tmp_path / "changed.pte"
    pte.write_bytes(bytes(data))
    done = _load_and_call(pte)
    assert done.returncode == 0, f"the process died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("ProgramError:"), done.stdout
    assert f"names value {item}, but the method has" in done.stdout, done.stdout
