"""writeback_testing.cia_ops: torch's set of CompositeImplicitAutograd ops, remembered while the
op registry is unchanged, is always the set torch itself computes (its own function, called
fresh), and follows a custom op library defined or dropped."""

from __future__ import annotations

from typing import Any

import torch
from writeback_testing.cia_ops import _remembering, remember_cia_ops


def _torch_own() -> set[Any]:
    from torch._export import utils

    fresh: set[Any] = getattr(utils._collect_all_valid_cia_ops, "__wrapped__", utils._collect_all_valid_cia_ops)()
    return fresh


def test_every_caller_of_torch_gets_the_set_torch_computes() -> None:
    import torch._export.utils
    import torch.export.decomp_utils
    import torch.export.exported_program

    remember_cia_ops()
    remember_cia_ops()  # a second call changes nothing
    callers = (torch._export.utils, torch.export.exported_program, torch.export.decomp_utils)
    functions = {id(module._collect_all_valid_cia_ops) for module in callers}
    assert len(functions) == 1
    remembered = torch._export.utils._collect_all_valid_cia_ops
    assert getattr(remembered, "__wrapped__").__module__ == "torch._export.utils"  # noqa: B009  # not typed
    assert remembered() == _torch_own()
    assert torch.ops.aten.linear.default in remembered()  # aten's part: linear is composite


def test_a_custom_op_library_defined_then_dropped_is_followed() -> None:
    calls = []

    def counted() -> set[Any]:
        calls.append(1)
        return _torch_own()

    collect = _remembering(counted)
    before = collect()
    assert collect() == before and len(calls) == 1  # the registry unchanged: remembered
    with torch.library._scoped_library("writeback_cia_test", "DEF") as lib:
        lib.define("double(Tensor x) -> Tensor")
        lib.impl("double", lambda x: x * 2, "CompositeImplicitAutograd")
        op = torch.ops.writeback_cia_test.double.default
        during = collect()
        assert op in during and op not in before
        assert during == _torch_own()
        assert len(calls) == 2
    after = collect()
    assert op not in after and after == _torch_own()
    assert len(calls) == 3


def test_a_caller_changing_its_set_does_not_change_the_next_one() -> None:
    collect = _remembering(_torch_own)
    first = collect()
    first.clear()
    assert collect() == _torch_own()
