"""The example third-party backend reads its blob with core's safe helpers: hostile plans are
refused in ``init`` by name, and the valid plan does what ``index_copy`` does."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from writeback_core.blob import BlobError
from writeback_core.meta import IN_PLACE_OUTPUTS_SPEC
from writeback_example_backend.backend import ExampleRuntimeDelegate

_PLAN = {"dim": 0, "dest": 0, "index": 1, "source": 2, "inputs": 3}


def test_valid_plan_copies_rows_as_index_copy_does() -> None:
    delegate = ExampleRuntimeDelegate()
    handle = delegate.init(json.dumps(_PLAN).encode(), {})
    dest, out = torch.zeros(3, 2), torch.full((3, 2), -1.0)
    delegate.execute(handle, [dest, torch.tensor([2]), torch.tensor([[5.0, 6.0]]), out])
    assert out.tolist() == [[0.0, 0.0], [0.0, 0.0], [5.0, 6.0]]
    assert not dest.any()  # not told to write in place
    spec = json.dumps([{"output": 0, "input": 0}]).encode()
    handle = delegate.init(json.dumps(_PLAN).encode(), {IN_PLACE_OUTPUTS_SPEC: spec})
    delegate.execute(handle, [dest, torch.tensor([1]), torch.tensor([[7.0, 8.0]]), out])
    assert dest.tolist() == [[0.0, 0.0], [7.0, 8.0], [0.0, 0.0]]


@pytest.mark.parametrize("key", sorted(_PLAN))
@pytest.mark.parametrize("wrong", ["1", 1.0, None, [1], {"$v": 1}, True, -1, 99])
def test_wrong_type_or_range_in_every_field_refused_in_init(key: str, wrong: Any) -> None:
    plan = {**_PLAN, key: wrong}
    if key in ("dim", "inputs") and wrong == 99:
        plan[key] = -1  # large is a valid plan: execute checks it against the call
    with pytest.raises(BlobError, match=rf"example delegate blob: field {key} ="):
        ExampleRuntimeDelegate().init(json.dumps(plan).encode(), {})


@pytest.mark.parametrize("blob", [b"\xff\xfe", b"[1, 2]", b'{"dim": 0}', json.dumps({**_PLAN, "op": "exec"}).encode()])
def test_malformed_plan_refused_in_init(blob: bytes) -> None:
    with pytest.raises(BlobError, match="example delegate blob"):
        ExampleRuntimeDelegate().init(blob, {})


def test_malformed_in_place_spec_refused_in_init() -> None:
    for raw in (b"{}", b'[{"output": 0}]', b'[{"output": 0, "input": "0"}]', b'[{"output": 1, "input": 0}]'):
        with pytest.raises(BlobError, match=IN_PLACE_OUTPUTS_SPEC):
            ExampleRuntimeDelegate().init(json.dumps(_PLAN).encode(), {IN_PLACE_OUTPUTS_SPEC: raw})


def test_call_with_another_argument_count_than_the_plan_raises_before_writing() -> None:
    delegate = ExampleRuntimeDelegate()
    handle = delegate.init(json.dumps({**_PLAN, "inputs": 9}).encode(), {})
    out = torch.full((3, 2), -1.0)
    with pytest.raises(ValueError, match="expects 9 inputs and 1 output, got 4 arguments"):
        delegate.execute(handle, [torch.zeros(3, 2), torch.tensor([2]), torch.ones(1, 2), out])
    assert (out == -1).all()
