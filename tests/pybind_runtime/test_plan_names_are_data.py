"""Operator names in a .pte's plan are looked up in torch's registry by name, never through
attribute access: a name that walks ``torch.ops`` attributes finds no schema and runs nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from writeback_pybind_runtime import _pte_operators


def test_schema_of_a_real_operator_is_found() -> None:
    schema = _pte_operators._schema("aten::add", "out")
    assert schema is not None and str(schema).startswith("aten::add.out(Tensor self, Tensor other")
    assert _pte_operators._schema("aten::neg", "default") is not None


@pytest.mark.parametrize(
    ("name", "overload"),
    [("import_module", "__call__"), ("aten::__class__", "__init__"), ("load_library", "default"), ("os::system", "")],
)
def test_operator_name_walking_attributes_finds_nothing_no_code_runs(
    name: str, overload: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "__call__.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _pte_operators._schema.cache_clear()
    assert _pte_operators._schema(name, overload) is None
    assert not marker.exists()
    sys.modules.pop("__call__", None)
