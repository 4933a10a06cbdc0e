"""Hostile MLX blobs and out-of-range indices: refused by name, nothing run, no state changed.

The blobs here are written by hand with :class:`DelegateProgram` so that every
field is known; the valid one is first checked against values worked out by hand.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from writeback_core.blob import BlobError
from writeback_mlx_backend import MLXDelegate
from writeback_mlx_backend.delegate_program import MAGIC, MAX_HEADER_BYTES, pack

from tests.hostile import at, fields, replaced, wrong_values
from tests.mlx_backend.embedding_cache_blob import embedding_cache_program, run_embedding_cache


def test_the_valid_blob_runs_as_worked_out_by_hand() -> None:
    program = embedding_cache_program()
    # The zero-filled cache takes no bytes: the data section holds the 60-byte embedding only.
    assert program.header()["state"]["cache"] == {"zeros": True, "dtype": "float32", "shape": [4, 3]}
    assert len(program.data) == 60
    delegate = MLXDelegate()
    handle = delegate.init(program.to_bytes(), {})
    r, s = run_embedding_cache(delegate, handle, 2, 1, [1.0, 1.0, 1.0])
    assert r.tolist() == [[7.0, 8.0, 9.0]]  # emb[2] = 6, 7, 8
    assert s.tolist() == [7.0, 8.0, 9.0]
    r, s = run_embedding_cache(delegate, handle, 4, 3, [0.0, 0.0, 0.0])
    assert r.tolist() == [[12.0, 13.0, 14.0]]
    assert s.tolist() == [19.0, 21.0, 23.0]  # the cache kept row 1


def test_non_zero_initial_state_comes_back_from_its_bytes() -> None:
    program = embedding_cache_program()
    program.state["cache"] = program.add_tensor(torch.ones(4, 3))
    assert "offset" in program.header()["state"]["cache"]
    delegate = MLXDelegate()
    handle = delegate.init(program.to_bytes(), {})
    r, s = run_embedding_cache(delegate, handle, 2, 1, [1.0, 1.0, 1.0])
    assert r.tolist() == [[7.0, 8.0, 9.0]]
    assert s.tolist() == [10.0, 11.0, 12.0]  # rows 0, 2 and 3 still ones, row 1 = r


@pytest.mark.parametrize("token", [5, 6, 1 << 40, -1, -6])
def test_out_of_range_token_raises_naming_op_index_size_state_unchanged(token: int) -> None:
    delegate = MLXDelegate()
    handle = delegate.init(embedding_cache_program().to_bytes(), {})
    run_embedding_cache(delegate, handle, 2, 1, [1.0, 1.0, 1.0])
    r, s = torch.full((1, 3), -7.0), torch.full((3,), -7.0)
    with pytest.raises(
        IndexError, match=rf"embedding: index {token} at position 0 is out of range for dimension 0 of size 5"
    ):
        delegate.execute(handle, [torch.tensor([token]), torch.tensor([2]), torch.ones(1, 3), r, s])
    assert r.tolist() == [[-7.0] * 3] and s.tolist() == [-7.0] * 3
    # The delegate-owned cache is as the good call left it: the next call sees only row 1.
    _, s = run_embedding_cache(delegate, handle, 0, 3, [0.0, 0.0, 0.0])
    assert s.tolist() == [7.0, 9.0, 11.0]


def _with_node(node: dict[str, Any]) -> bytes:
    program = embedding_cache_program()
    program.nodes.insert(2, node)
    return program.to_bytes()


def test_out_of_range_select_refused_in_init_not_crashes() -> None:
    for index in (3, 9, -4, -100):
        blob = _with_node(
            {
                "name": "x",
                "op": "aten.select_copy.int",
                "args": [{"$v": "r"}, 1, index],
                "kwargs": {},
                "dtype": "float32",
            }
        )
        with pytest.raises(
            BlobError, match=rf"nodes\[2\] = 'x': .*index {index} is out of bounds for a dimension of size 3"
        ):
            MLXDelegate().init(blob, {})


def test_zero_slice_step_refused_in_init_not_crashes() -> None:
    blob = _with_node(
        {
            "name": "x",
            "op": "aten.slice_copy.Tensor",
            "args": [{"$v": "r"}, 1, 0, 3, 0],
            "kwargs": {},
            "dtype": "float32",
        }
    )
    with pytest.raises(BlobError, match="slice: step 0 must be a positive int"):
        MLXDelegate().init(blob, {})


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ([{"$v": "r"}, [2]], r"normalized_shape \[2\] is not the last dimensions of input \(1, 3\)"),
        ([{"$v": "r"}, [1, 1, 3]], r"normalized_shape \[1, 1, 3\] is not the last dimensions"),
        ([{"$v": "r"}, [3], {"$v": "emb"}], r"weight of shape \(5, 3\), expected normalized_shape \[3\]"),
    ],
    ids=["other_size", "more_dims_than_input", "weight_shape"],
)
def test_layer_norm_over_dimensions_the_input_lacks_refused_in_init_naming_them(args: list[Any], match: str) -> None:
    """ATen refuses these; MLX would broadcast some of them into an answer."""
    blob = _with_node({"name": "x", "op": "aten.layer_norm.default", "args": args, "kwargs": {}, "dtype": "float32"})
    with pytest.raises(BlobError, match=match):
        MLXDelegate().init(blob, {})


@pytest.mark.parametrize(
    "op",
    [
        "import_module.__call__.__call__",
        "builtins.exec",
        "aten.as_strided.default",
        "aten.add.Tensor.__class__",
        "__class__",
    ],
)
def test_hostile_op_name_refused_in_init(op: str) -> None:
    program = embedding_cache_program()
    program.nodes[1]["op"] = op
    with pytest.raises(BlobError, match=r"mlx delegate blob: field nodes\[1\]\.op") as caught:
        MLXDelegate().init(program.to_bytes(), {})
    assert caught.value.value == op


@pytest.mark.parametrize("where", ["node", "tag", "constant", "input"])
def test_unknown_dtype_key_refused_in_init(where: str) -> None:
    program = embedding_cache_program()
    if where == "node":
        program.nodes[0]["dtype"] = "__builtins__"
    elif where == "tag":
        program.nodes[3]["kwargs"]["dtype"] = {"$dtype": "load"}
    elif where == "constant":
        header = program.header()
        header["constants"]["emb"]["dtype"] = "object"
        return _refused_header(header, "constants")
    else:
        program.input_meta[0]["dtype"] = "complex128"
    with pytest.raises(BlobError, match="not a known MLX dtype"):
        MLXDelegate().init(program.to_bytes(), {})
    return None


def _blob_of(header: dict[str, Any], data: bytes) -> bytes:
    return pack(header, data)


def _refused_header(header: dict[str, Any], field: str) -> None:
    with pytest.raises(BlobError, match=rf"field {field}"):
        MLXDelegate().init(_blob_of(header, bytes(embedding_cache_program().data)), {})


def test_wrong_type_in_every_field_refused_in_init_before_any_op_runs() -> None:
    program = embedding_cache_program()
    header, data = program.header(), bytes(program.data)
    refused = accepted = 0
    for path in list(fields(header))[1:]:
        for wrong in wrong_values(at(header, path), "$v"):
            changed = replaced(header, path, wrong)
            delegate = MLXDelegate()
            try:
                handle = delegate.init(_blob_of(changed, data), {})
            except BlobError:
                refused += 1
                continue
            # Only a literal that another JSON type also satisfies may pass (an int where
            # a number goes, a node dtype of None); such a blob still runs.
            assert path[0] == "nodes", f"{path} = {wrong!r} was accepted by init"
            run_embedding_cache(delegate, handle, 1, 0, [0.0, 0.0, 0.0])
            accepted += 1
    assert refused > 150 and accepted < 5, (refused, accepted)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda h: h["constants"]["emb"].update(offset=10**9), "pass the data section's end"),
        (lambda h: h["constants"]["emb"].update(nbytes=8), "needs 60 bytes"),
        (lambda h: h["constants"]["emb"].update(shape=[400, 3]), "needs 4800 bytes"),
        (lambda h: h["state"]["cache"].update(zeros=False), "a record without bytes must be zeros"),
        (lambda h: h["state"]["cache"].update(offset=0), "extra"),
        (lambda h: h["state"]["cache"].update(shape=[-4, 3]), "out of range"),
        (lambda h: h["state"]["cache"].update(shape=[2**40, 3]), "MLX dimensions hold at most 2147483647"),
        (lambda h: h["state"]["cache"].update(shape=[2**30, 2**30, 16]), "more than this machine's"),
        (lambda h: h["state"]["cache"].update(dtype="complex64"), "not a known MLX dtype"),
        (lambda h: h["state_updates"].update(nosuch="c"), "names no state buffer"),
        (lambda h: h["state_updates"].update(cache="later"), "names no value"),
        (lambda h: h["nodes"][0]["args"][1].update({"$v": "s"}), "names no input, constant, state or earlier node"),
        (lambda h: h["in_place"].append({"output": 5, "input": 0, "node": "c"}), "out of range"),
        (lambda h: h["nodes"].append(dict(h["nodes"][0])), "names a value defined before"),
        (lambda h: h.update(extra=1), "extra"),
    ],
)
def test_inconsistent_field_refused_in_init(change: Any, match: str) -> None:
    program = embedding_cache_program()
    header = program.header()
    change(header)
    with pytest.raises(BlobError, match=match):
        MLXDelegate().init(_blob_of(header, bytes(program.data)), {})


def test_truncated_or_oversized_header_refused() -> None:
    blob = embedding_cache_program().to_bytes()
    for cut in (4, 12, 40):
        with pytest.raises(BlobError):
            MLXDelegate().init(blob[:cut], {})
    lying = MAGIC + struct.pack("<Q", 2**62) + blob[16:]
    with pytest.raises(BlobError, match="header length"):
        MLXDelegate().init(lying, {})


def _raw_header(text: bytes) -> bytes:
    return MAGIC + struct.pack("<Q", len(text)) + text


def test_header_that_is_not_zlib_or_inflates_too_far_refused() -> None:
    with pytest.raises(BlobError, match="not zlib-compressed JSON"):
        MLXDelegate().init(_raw_header(json.dumps(embedding_cache_program().header()).encode()), {})
    bomb = zlib.compress(b" " * (MAX_HEADER_BYTES + 1), 9)  # 64 KiB that would inflate past the limit
    with pytest.raises(BlobError, match="a header inflates to at most that"):
        MLXDelegate().init(_raw_header(bomb), {})
    whole = zlib.compress(json.dumps(embedding_cache_program().header()).encode())
    with pytest.raises(BlobError, match="truncated or followed by other bytes"):
        MLXDelegate().init(_raw_header(whole[:-4]), {})


def test_in_place_compile_spec_of_wrong_shape_refused() -> None:
    blob = embedding_cache_program().to_bytes()
    for raw in (b"not json", b'{"output": 0}', b'[{"output": "0", "input": 0}]', b'[{"output": 0, "input": 9}]'):
        with pytest.raises(BlobError, match=r"writeback\.in_place_outputs"):
            MLXDelegate().init(blob, {"writeback.in_place_outputs": raw})


def test_blob_data_is_copied_not_referenced() -> None:
    """The constants are MLX's own copies: changing the bytes after init changes nothing."""
    raw = bytearray(embedding_cache_program().to_bytes())
    delegate = MLXDelegate()
    handle = delegate.init(bytes(raw), {})
    raw[-60:] = np.zeros(15, dtype=np.float32).tobytes()
    r, _ = run_embedding_cache(delegate, handle, 2, 0, [0.0, 0.0, 0.0])
    assert r.tolist() == [[6.0, 7.0, 8.0]]


def test_whole_write_spec_of_another_shape_refused_in_init() -> None:
    """An in-place output that is no write op replaces its input whole: only a value of the
    input's shape and dtype may (``s`` is ``[3]``, input ``row`` is ``[1, 3]``)."""
    blob = embedding_cache_program().to_bytes()
    with pytest.raises(ValueError, match=r"output 1 into input 2 in place.*nor a new value of its shape"):
        MLXDelegate().init(blob, {"writeback.in_place_outputs": b'[{"output": 1, "input": 2}]'})


def test_whole_write_spec_replaces_the_input_after_the_call_as_worked_out_by_hand() -> None:
    """Output ``r`` (``emb[tok] + row``, ``[1, 3]``) written whole into input ``row``: the
    caller's ``row`` holds ``r`` after the call, read as it was before it."""
    delegate = MLXDelegate()
    handle = delegate.init(
        embedding_cache_program().to_bytes(), {"writeback.in_place_outputs": b'[{"output": 0, "input": 2}]'}
    )
    row, s = torch.ones(1, 3), torch.zeros(3)
    unused = torch.empty(0)  # the pass gives the replaced output no memory
    delegate.execute(handle, [torch.tensor([2]), torch.tensor([1]), row, unused, s])
    assert row.tolist() == [[7.0, 8.0, 9.0]]  # emb[2] = 6, 7, 8, plus the ones it read
    assert s.tolist() == [7.0, 8.0, 9.0]
    delegate.execute(handle, [torch.tensor([0]), torch.tensor([2]), row, unused, s])
    assert row.tolist() == [[7.0, 9.0, 11.0]]  # emb[0] = 0, 1, 2, plus the row of the last call
    assert s.tolist() == [14.0, 17.0, 20.0]  # cache rows 1 and 2
