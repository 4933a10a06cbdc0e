"""An adapter that uses torch-tensorrt's ExecuTorch delegate as the aliasing engine.

Import-guarded: torch-tensorrt needs CUDA TensorRT libraries (and torch 2.14),
and raises on import without them, so :func:`available` says whether this
adapter can be built at all. It cannot be tested on a CPU-only machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from writeback_core.types import EngineWrite

from writeback_trt_copyback.engine import op_excluded
from writeback_trt_copyback.rule import TensorRTCacheRule

__all__ = ["TensorRTEngine", "available", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """``None`` when ``torch_tensorrt`` imports; otherwise why not."""
    try:
        import torch_tensorrt  # noqa: F401
    except Exception as error:  # its import raises more than ImportError without CUDA
        return f"torch_tensorrt cannot be imported here ({type(error).__name__}: {error})"
    return None


def available() -> bool:
    """Whether the adapter can be used in this process."""
    return unavailable_reason() is None


@dataclass(frozen=True)
class TensorRTEngine:
    """torch-tensorrt's ExecuTorch delegate as an :class:`~writeback_core.types.AliasingEngine`.

    ``torch_executed_ops`` is torch-tensorrt's exclusion list (matched by
    :func:`~writeback_trt_copyback.engine.op_excluded`, as its partitioner
    matches it). ``read_aliased_io`` reads ``output binding -> input index`` out
    of one delegate's processed blob; torch-tensorrt keeps it in the serialized
    engine's metadata (``ALIASED_IO``), whose layout this package does not pin,
    so the caller supplies the reader for their torch-tensorrt version.
    """

    read_aliased_io: Callable[[bytes], Mapping[str, int]]
    torch_executed_ops: tuple[str, ...] = ()
    rule: TensorRTCacheRule = field(default_factory=TensorRTCacheRule)
    name: str = "tensorrt"
    backend_id: str = "TensorRTBackend"

    def __post_init__(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"TensorRTEngine needs torch-tensorrt: {reason}")

    def alias_refusal(self, write: EngineWrite) -> str | None:
        """TensorRT's rule, after its ``torch_executed_ops`` exclusion list."""
        if op_excluded(write.write.op, self.torch_executed_ops):
            return f"{write.write.op} is in torch_executed_ops, so it never reaches TensorRT"
        return self.rule.alias_refusal(write)

    def aliased_io(self, processed: bytes) -> Mapping[str, int]:
        """The engine's own ``aliased_io``, through ``read_aliased_io``."""
        return dict(self.read_aliased_io(processed))

    def partitioner(self) -> Any:
        """torch-tensorrt's ``TensorRTPartitioner``."""
        from torch_tensorrt.executorch import TensorRTPartitioner

        return TensorRTPartitioner()
