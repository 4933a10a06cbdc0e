"""A blob written by hand with :class:`DelegateProgram`, every field known: a token's
embedding plus a row, written into a delegate-owned cache at a position. The hostile-blob
tests start from it and check it first against values worked out by hand."""

from __future__ import annotations

from typing import Any

import torch
from writeback_mlx_backend import MLXDelegate
from writeback_mlx_backend.delegate_program import DelegateProgram

EMBEDDING = torch.arange(15, dtype=torch.float32).reshape(5, 3)  # 5 tokens, width 3


def embedding_cache_program() -> DelegateProgram:
    """``e = emb[tok]``; ``r = e + row``; ``cache[pos] = r`` (delegate-owned state);
    outputs ``r`` and ``cache.sum(0)``."""
    program = DelegateProgram(
        inputs=["tok", "pos", "row"],
        input_meta=[
            {"shape": [1], "dtype": "int64"},
            {"shape": [1], "dtype": "int64"},
            {"shape": [1, 3], "dtype": "float32"},
        ],
        outputs=[{"$v": "r"}, {"$v": "s"}],
        nodes=[
            {
                "name": "e",
                "op": "aten.embedding.default",
                "args": [{"$v": "emb"}, {"$v": "tok"}],
                "kwargs": {},
                "dtype": "float32",
            },
            {
                "name": "r",
                "op": "aten.add.Tensor",
                "args": [{"$v": "e"}, {"$v": "row"}],
                "kwargs": {},
                "dtype": "float32",
            },
            {
                "name": "c",
                "op": "aten.index_copy.default",
                "args": [{"$v": "cache"}, 0, {"$v": "pos"}, {"$v": "r"}],
                "kwargs": {},
                "dtype": "float32",
            },
            {
                "name": "s",
                "op": "aten.sum.dim_IntList",
                "args": [{"$v": "c"}, [0]],
                "kwargs": {"dtype": {"$dtype": "float32"}},
                "dtype": "float32",
            },
        ],
        state_updates={"cache": "c"},
    )
    program.constants["emb"] = program.add_tensor(EMBEDDING)
    program.state["cache"] = program.add_tensor(torch.zeros(4, 3))
    return program


def run_embedding_cache(
    delegate: MLXDelegate, handle: Any, tok: int, pos: int, row: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    r, s = torch.zeros(1, 3), torch.zeros(3)
    delegate.execute(handle, [torch.tensor([tok]), torch.tensor([pos]), torch.tensor([row]), r, s])
    return r, s
