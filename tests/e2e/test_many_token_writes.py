"""A decoder's cache written n tokens at a time (the runner's one-call prefill) stays written in
place on the stock runtime's backends, and every call answers as eager does.

Each form writeback writes in place -- ``index_copy_``, ``index_put_`` (``k[pos] = v``) and a
slice assignment at a run-time start -- over a token dimension exported dynamic, lowered
through the one lowering path for ``portable`` and ``xnnpack``, then run by ExecuTorch's
stock runtime for calls of 3, 1 and 2 tokens.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from executorch.runtime import Runtime
from torch import nn
from writeback_core import load_registry
from writeback_core.exporting import export_model
from writeback_core.lowering import lower

POSITIONS = 16
WIDTH = 4


def _index_copy(k: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    k.index_copy_(0, pos, x)


def _index_put(k: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    k[pos] = x


def _slice(k: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    start = pos[0].item()
    torch._check(start >= 0)
    torch._check(start + x.shape[0] <= POSITIONS)
    k[start : start + x.shape[0]] = x


FORMS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
    "index_copy_": _index_copy,
    "index_put_": _index_put,
    "slice_assignment": _slice,
}


class Cache(nn.Module):
    def __init__(self, write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, WIDTH)
        self.register_buffer("k", torch.zeros(POSITIONS, WIDTH))
        self.write = write

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.write(self.k, pos, self.embed(tokens[0]))
        return self.k.sum(dim=1) * 1.0


CALLS = [(3, 0), (1, 3), (2, 4)]  # (tokens, first position)


def _inputs(n: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.arange(n).reshape(1, n) % 10 + start, torch.arange(start, start + n))


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_n_token_writes_stay_in_place_and_every_call_answers_as_eager(form: str, backend: str) -> None:
    torch.manual_seed(0)
    module = Cache(FORMS[form])
    eager = Cache(FORMS[form])
    eager.load_state_dict(module.state_dict())
    n = torch.export.Dim("n", min=1, max=POSITIONS)
    program = export_model(module, _inputs(2, 0), dynamic_shapes=({1: n}, {0: n}))
    registry = load_registry()
    lowered = lower(program, registry, registry.backends()[backend])
    assert lowered.write_back_bytes == {}, f"{form} on {backend}: whole-cache copy left"
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.pte"
        path.write_bytes(lowered.pte)
        method = Runtime.get().load_program(path).load_method("forward")
        for tokens, start in CALLS:
            args = _inputs(tokens, start)
            (got,) = method.execute(list(args))
            with torch.no_grad():
                expected = eager(*args)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
