"""Core's one parser of the in-place compile spec, and the runtime delegates that read it.

The spec is written by the pass that drops a write-back; every delegate reads it
with ``writeback_core.in_place_outputs`` and refuses, in ``init``, an entry it
cannot honour (ignoring one would leave an output unwritten and its input stale).
"""

from __future__ import annotations

import json

import pytest
import torch
from writeback_core import InPlaceOutput, encode_in_place_outputs, in_place_outputs
from writeback_core.blob import BlobError
from writeback_core.meta import IN_PLACE_OUTPUTS_SPEC
from writeback_example_backend.backend import ExampleRuntimeDelegate
from writeback_trt_copyback.kv_alias_delegate import KVAliasRuntimeDelegate

from tests.trt_copyback.test_hostile_blobs import _valid_record

_PLAN = {"dim": 0, "dest": 0, "index": 1, "source": 2, "inputs": 3}


def test_parser_reads_back_what_the_encoder_writes_in_order() -> None:
    raw = encode_in_place_outputs([(1, 3), (0, 0)])
    assert json.loads(raw) == [{"output": 1, "input": 3}, {"output": 0, "input": 0}]
    entries = in_place_outputs({IN_PLACE_OUTPUTS_SPEC: raw}, "toy", num_inputs=4, num_outputs=2)
    assert entries == [InPlaceOutput(output=1, input=3), InPlaceOutput(output=0, input=0)]
    assert in_place_outputs({}, "toy", 4, 2) == []


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        ([(2, 0)], r"\[0\]\.output = 2: out of range \[0, 2\)"),
        ([(0, 4)], r"\[0\]\.input = 4: out of range \[0, 4\)"),
        ([(0, 1), (0, 2)], r"\[1\]\.output = 0: this output is already written in place"),
    ],
)
def test_parser_refuses_an_entry_out_of_range_or_twice(pairs: list[tuple[int, int]], match: str) -> None:
    with pytest.raises(BlobError, match=match):
        in_place_outputs({IN_PLACE_OUTPUTS_SPEC: encode_in_place_outputs(pairs)}, "toy", 4, 2)


def test_example_delegate_refuses_writing_its_output_into_another_input_than_the_destination() -> None:
    spec = {IN_PLACE_OUTPUTS_SPEC: encode_in_place_outputs([(0, 1)])}  # input 1 is the index
    with pytest.raises(BlobError, match=r"only into its destination \(input 0\)"):
        ExampleRuntimeDelegate().init(json.dumps(_PLAN).encode(), spec)


def test_example_delegate_told_to_write_in_place_writes_the_destination_as_index_copy_does() -> None:
    delegate = ExampleRuntimeDelegate()
    handle = delegate.init(json.dumps(_PLAN).encode(), {IN_PLACE_OUTPUTS_SPEC: encode_in_place_outputs([(0, 0)])})
    dest, out = torch.zeros(3, 2), torch.full((3, 2), -1.0)
    expected = torch.zeros(3, 2).index_copy_(0, torch.tensor([2]), torch.tensor([[5.0, 6.0]]))
    delegate.execute(handle, [dest, torch.tensor([2]), torch.tensor([[5.0, 6.0]]), out])
    assert torch.equal(dest, expected)
    assert (out == -1).all()  # the output is left unwritten: the destination holds the value


def test_kv_alias_delegate_refuses_an_in_place_entry_its_engine_did_not_alias() -> None:
    """The kv-alias blob aliases only ``update:`` writes (no output): output 0 into the
    cache (input 3) is a write the engine does not perform in place."""
    blob = json.dumps(_valid_record()).encode()
    KVAliasRuntimeDelegate().init(blob, {})
    with pytest.raises(BlobError, match=r"the engine aliased only \[\]"):
        KVAliasRuntimeDelegate().init(blob, {IN_PLACE_OUTPUTS_SPEC: encode_in_place_outputs([(0, 3)])})


def test_example_delegate_broadcasts_values_as_index_put_does() -> None:
    """``cache[:, pos] = k`` with ``k`` of shape [1, 1, 2] (ExecuTorch Llama's form) writes
    ``k`` at ``pos`` like eager's index_put; index_copy alone refused the lower-rank values."""
    plan = {"dim": 1, "dest": 0, "index": 1, "source": 2, "inputs": 3}
    delegate = ExampleRuntimeDelegate()
    handle = delegate.init(json.dumps(plan).encode(), {IN_PLACE_OUTPUTS_SPEC: encode_in_place_outputs([(0, 0)])})
    dest, values = torch.zeros(1, 4, 2), torch.tensor([5.0, 6.0])
    expected = torch.zeros(1, 4, 2)
    expected[:, torch.tensor([3])] = values
    delegate.execute(handle, [dest, torch.tensor([3]), values, torch.empty(1, 4, 2)])
    assert torch.equal(dest, expected)


def test_example_delegate_refuses_values_that_do_not_broadcast_and_writes_nothing() -> None:
    plan = {"dim": 1, "dest": 0, "index": 1, "source": 2, "inputs": 3}
    delegate = ExampleRuntimeDelegate()
    handle = delegate.init(json.dumps(plan).encode(), {IN_PLACE_OUTPUTS_SPEC: encode_in_place_outputs([(0, 0)])})
    dest = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match=r"values of shape \[3\] do not broadcast to the indexed region \[1, 1, 2\]"):
        delegate.execute(handle, [dest, torch.tensor([3]), torch.ones(3), torch.empty(1, 4, 2)])
    assert not dest.any()
