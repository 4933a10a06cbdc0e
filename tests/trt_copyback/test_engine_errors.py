"""The kv-alias engine's own bad-input errors: clear, naming what is wrong."""

from __future__ import annotations

import pytest
import torch
from writeback_trt_copyback import KVAliasEngine
from writeback_trt_copyback._blob import Blob
from writeback_trt_copyback.kv_alias_delegate import KVAliasRuntimeDelegate


def test_a_blob_of_another_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"not a kv-alias engine blob \(expected format"):
        KVAliasRuntimeDelegate().init(b'{"format": "other"}', {})
    with pytest.raises(ValueError, match="not UTF-8 JSON"):
        KVAliasEngine().aliased_io(b"\x00\x01 not json")


def test_wrong_argument_count_names_expected_and_actual() -> None:
    blob = Blob(
        inputs=["x"],
        steps=[{"name": "y", "op": "aten.neg.default", "args": [{"$ref": "x"}], "kwargs": {"$dict": {}}}],
        outputs=[{"$ref": "y"}],
    )
    delegate = KVAliasRuntimeDelegate()
    handle = delegate.init(blob.to_bytes(), {})
    with pytest.raises(ValueError, match=r"expects 1 inputs and 1 outputs, got 3 arguments"):
        delegate.execute(handle, [torch.ones(2), torch.ones(2), torch.ones(2)])
    out = torch.zeros(2)
    delegate.execute(handle, [torch.ones(2), out])
    assert out.tolist() == [-1.0, -1.0]
