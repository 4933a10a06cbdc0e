"""The torch-tensorrt adapter: import-guarded, and cannot run on this CPU-only machine."""

from __future__ import annotations

import pytest
import torch
from writeback_trt_copyback import lift_mutated_buffers
from writeback_trt_copyback.tensorrt import TensorRTEngine, available, unavailable_reason

from tests.trt_copyback.conftest import export
from tests.trt_copyback.models import IndexCopyWrite

REASON = (
    "torch-tensorrt cannot run here: it needs torch 2.14 and CUDA TensorRT libraries and "
    "raises on import without them (packages/trt-copyback/README.md)"
)


@pytest.mark.skipif(available(), reason="torch-tensorrt is importable here")
def test_adapter_refuses_to_build_without_torch_tensorrt() -> None:
    assert unavailable_reason() is not None
    with pytest.raises(RuntimeError, match="TensorRTEngine needs torch-tensorrt"):
        TensorRTEngine(read_aliased_io=lambda blob: {})


@pytest.mark.skipif(not available(), reason=REASON)
def test_adapter_applies_torch_executed_ops_before_the_rule() -> None:
    engine = TensorRTEngine(read_aliased_io=lambda blob: {}, torch_executed_ops=("aten.index_put",))
    program = export(IndexCopyWrite((1, 2, 16, 4), 2), (torch.zeros(1, 2, 1, 4), torch.tensor([1])))
    (cls,) = lift_mutated_buffers(program, engine).buffers
    assert not cls.aliased and "torch_executed_ops" in str(cls.reason)


@pytest.mark.skipif(not available(), reason=REASON)
def test_adapter_offers_torch_tensorrt_partitioner() -> None:
    engine = TensorRTEngine(read_aliased_io=lambda blob: {})
    assert type(engine.partitioner()).__name__ == "TensorRTPartitioner"
