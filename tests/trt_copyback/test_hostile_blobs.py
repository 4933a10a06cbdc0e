"""Hostile kv-alias blobs: file content picks no code, every bad field is refused in ``init``.

A blob is read from a .pte that may come from anywhere. Each test crafts one and
checks that the delegate raises :class:`BlobError` naming the field before any op
runs, and that nothing else happened (a sentinel module that writes a file when
imported is never imported).
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from writeback_core.blob import BlobError
from writeback_trt_copyback._blob import FORMAT
from writeback_trt_copyback.kv_alias_delegate import KVAliasRuntimeDelegate

from tests.hostile import at, fields, replaced, wrong_values

_SENTINEL_MODULE = "writeback_hostile_blob_sentinel"


def _valid_record() -> dict[str, Any]:
    """A blob using every step kind, computing by hand:

    ``w = 2``; ``y = neg(x) + w``; ``cache[:, 1:2] = y`` (slice update);
    ``cache.index_copy_(1, pos, y)``; ``cache[rows] = y`` via ``index_put`` with
    a ``None`` index; outputs ``y`` and ``sum(cache, [1])``.
    """
    w = torch.full((2, 1), 2.0)
    return {
        "format": FORMAT,
        "inputs": ["x", "pos", "rows", "cache"],
        "constants": {
            "w": {"dtype": "float32", "shape": [2, 1], "data": base64.b64encode(w.numpy().tobytes()).decode()}
        },
        "steps": [
            {"name": "n", "op": "aten.neg.default", "args": [{"$ref": "x"}], "kwargs": {"$dict": {}}},
            {"name": "y", "op": "aten.add.Tensor", "args": [{"$ref": "n"}, {"$ref": "w"}], "kwargs": {"$dict": {}}},
            {
                "name": "s",
                "input": 3,
                "update": "slice",
                "dim": 1,
                "start": 1,
                "length": 1,
                "src": {"$ref": "y"},
            },
            {
                "name": "c",
                "input": 3,
                "update": "index_copy",
                "dim": 1,
                "index": {"$ref": "pos"},
                "src": {"$ref": "y"},
            },
            {
                "name": "p",
                "input": 3,
                "update": "index_put",
                "indices": [None, {"$ref": "rows"}],
                "src": {"$ref": "y"},
            },
            {
                "name": "t",
                "op": "aten.sum.dim_IntList",
                "args": [{"$ref": "p"}, [1]],
                "kwargs": {"$dict": {"dtype": {"$dtype": "float32"}}},
            },
        ],
        "outputs": [{"$ref": "y"}, {"$ref": "t"}],
        "aliased_io": {"update:s": 3, "update:c": 3, "update:p": 3},
        "marked": [],
    }


def _run(record: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    delegate = KVAliasRuntimeDelegate()
    handle = delegate.init(json.dumps(record).encode(), {})
    x = torch.tensor([[1.0], [3.0]])
    cache = torch.zeros(2, 5)
    y, t = torch.zeros(2, 1), torch.zeros(2)
    delegate.execute(handle, [x, torch.tensor([3]), torch.tensor([4]), cache, y, t])
    return y, t, cache


def test_the_valid_blob_runs_as_worked_out_by_hand() -> None:
    y, t, cache = _run(_valid_record())
    # y = -x + 2 = [[1], [-1]]; the cache gets y in columns 1, 3 and 4.
    assert y.tolist() == [[1.0], [-1.0]]
    assert cache.tolist() == [[0.0, 1.0, 0.0, 1.0, 1.0], [0.0, -1.0, 0.0, -1.0, -1.0]]
    assert t.tolist() == [3.0, -3.0]


@pytest.fixture
def sentinel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A module on ``sys.path`` that writes a file when imported: proof of code run from a blob."""
    marker = tmp_path / "code-ran"
    (tmp_path / f"{_SENTINEL_MODULE}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop(_SENTINEL_MODULE, None)


# Op names that reach Python's import machinery, builtins or arbitrary torch functions
# through attribute chains from ``torch.ops`` (``torch.ops.import_module`` imports a
# module by name; ``load_library`` loads a shared library).
_HOSTILE_OPS = [
    "import_module.__call__.__call__",
    "load_library.__call__.__call__",
    "aten.__class__.__init__",
    "builtins.exec.default",
    "aten.add.Tensor.__class__",
    "aten.as_strided.default",
    "aten.set_.source_Storage",
]


@pytest.mark.parametrize("op", _HOSTILE_OPS)
def test_hostile_op_path_refused_in_init_no_code_runs(op: str, sentinel: Path) -> None:
    record = _valid_record()
    record["steps"][0] = {"name": "n", "op": op, "args": [_SENTINEL_MODULE], "kwargs": {"$dict": {}}}
    delegate = KVAliasRuntimeDelegate()
    with pytest.raises(BlobError, match=r"kv-alias delegate blob: field steps\[0\]\.op") as caught:
        delegate.init(json.dumps(record).encode(), {})
    assert caught.value.value == op
    assert not sentinel.exists()
    assert _SENTINEL_MODULE not in sys.modules


@pytest.mark.parametrize(
    ("tag", "value"),
    [("$dtype", "load"), ("$dtype", "__builtins__"), ("$layout", "sparse_coo"), ("$device", "meta"), ("$eval", "1")],
)
def test_unknown_enum_key_refused_in_init(tag: str, value: str) -> None:
    record = _valid_record()
    record["steps"][5]["kwargs"] = {"$dict": {"dtype": {tag: value}}}
    with pytest.raises(BlobError, match=r"field steps\[5\]\.kwargs") as caught:
        KVAliasRuntimeDelegate().init(json.dumps(record).encode(), {})
    assert value in str(caught.value) or tag in str(caught.value)


def test_wrong_type_in_every_field_refused_in_init_before_any_op_runs() -> None:
    """Every field of the valid blob, given a value of another JSON type, is refused in
    ``init`` by :class:`BlobError` naming that field: structure and names by the reader,
    op arguments by the op's schema. The one exception is a literal that another type
    also satisfies (an int where a ``Scalar`` goes): that blob must still run."""
    record = _valid_record()
    refused = accepted = 0
    for path in list(fields(record))[1:]:
        for wrong in wrong_values(at(record, path), "$ref"):
            blob = json.dumps(replaced(record, path, wrong)).encode()
            delegate = KVAliasRuntimeDelegate()
            try:
                handle = delegate.init(blob, {})
            except BlobError as error:
                assert error.field.startswith(str(path[0])), (path, wrong, error.field)
                refused += 1
                continue
            assert "args" in path or "$dict" in path, f"{path} = {wrong!r} was accepted by init"
            args = [torch.tensor([[1.0], [3.0]]), torch.tensor([3]), torch.tensor([4]), torch.zeros(2, 5)]
            delegate.execute(handle, [*args, torch.zeros(2, 1), torch.zeros(2)])
            accepted += 1
    assert refused > 150 and accepted < 5, (refused, accepted)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("constants", {"w": {"dtype": "float32", "shape": [2, 2], "data": "AAAA"}}, "needs 16 bytes"),
        ("constants", {"w": {"dtype": "float32", "shape": [2, 1], "data": "not base64!"}}, "not base64"),
        ("aliased_io", {"output9": 3}, "out of range"),
        ("aliased_io", {"outputs": 3}, "a binding is output<k>"),
        ("aliased_io", {"update:s": 17}, "out of range"),
        ("outputs", [{"$ref": "later"}], "names no input, constant or earlier step"),
    ],
)
def test_out_of_range_or_inconsistent_field_refused_in_init(field: str, value: Any, match: str) -> None:
    record = _valid_record()
    record[field] = value
    with pytest.raises(BlobError, match=match):
        KVAliasRuntimeDelegate().init(json.dumps(record).encode(), {})


def test_constants_are_not_unpickled() -> None:
    """The old encoding (``torch.save`` bytes) is refused: constants are raw bytes only."""
    import io

    buffer = io.BytesIO()
    torch.save(torch.ones(2, 1), buffer)
    record = _valid_record()
    record["constants"] = {"w": base64.b64encode(buffer.getvalue()).decode()}
    with pytest.raises(BlobError, match=r"field constants\['w'\]"):
        KVAliasRuntimeDelegate().init(json.dumps(record).encode(), {})
