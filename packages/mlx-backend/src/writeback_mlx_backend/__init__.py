"""writeback-mlx-backend: an ExecuTorch delegate that runs in MLX and writes state in place.

Names that need MLX are imported on first use, so ``import writeback_mlx_backend``
(and its entry-point plugin) never imports MLX.
"""

from __future__ import annotations

import importlib
from typing import Any

from writeback_mlx_backend._names import BACKEND_ID, BACKEND_NAME

__all__ = [
    "BACKEND_ID",
    "BACKEND_NAME",
    "MLXDelegate",
    "MLXPartitioner",
    "WritebackMLXBackend",
    "empty",
]

_LAZY = {
    "MLXDelegate": "writeback_mlx_backend.mlx_delegate",
    "MLXPartitioner": "writeback_mlx_backend.partitioner",
    "WritebackMLXBackend": "writeback_mlx_backend.preprocess",
    "empty": "writeback_mlx_backend.allocations",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'writeback_mlx_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
