"""``writeback_core.decompositions``: partitioning for XNNPACK skips exir's two decomposition
retraces that change nothing, and the ``.pte`` is the one exir makes with them, byte for byte,
and computes what the quantized eager module does."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from executorch.runtime import Runtime
from torch import nn
from torch.export import ExportedProgram
from writeback.session import assemble
from writeback_core import lowering
from writeback_core.exporting import export_model
from writeback_core.registry import load_registry
from writeback_decoders.quantize import QUANTIZATIONS, quantize


class _CachedProjection(nn.Module):
    """Projects a row, writes it into a cache at a position, and projects the whole cache."""

    cache: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.register_buffer("cache", torch.zeros(8, 64))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, position, self.proj(x))
        projected: torch.Tensor = self.proj(self.cache)
        return projected


def _lower(exported: ExportedProgram, monkeypatch: pytest.MonkeyPatch, *, skipping: bool) -> tuple[bytes, int]:
    """The ``.pte`` of ``exported`` lowered for XNNPACK, and how many times ``run_decompositions``
    retraced the whole program (the one with the cache; XNNPACK's preprocess calls it on its
    partitions too); ``skipping=False``: exir's own steps, none skipped."""
    calls: list[bool] = []
    real = ExportedProgram.run_decompositions

    def counted(self: ExportedProgram, *args: Any, **kwargs: Any) -> Any:
        calls.append("cache" in self.graph_signature.inputs_to_buffers.values())
        return real(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(ExportedProgram, "run_decompositions", counted)
        if not skipping:
            patch.setattr(lowering, "decompositions_once", lambda *_: nullcontext())
        pipeline = assemble(load_registry(), "xnnpack")
        lowered = lowering.lower(exported, pipeline.registry, pipeline.backend)
    return lowered.pte, sum(calls)


def test_xnnpack_partitioning_retraces_once_and_writes_exirs_pte_byte_for_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = quantize(_CachedProjection().eval(), "8da4w")
    exported = export_model(module, (torch.randn(1, 64), torch.tensor([0])))
    exirs, exirs_retraces = _lower(exported, monkeypatch, skipping=False)
    ours, our_retraces = _lower(exported, monkeypatch, skipping=True)
    # exir: functionalization, the decomposing trace, the trace for the kept ops XNNPACK turned
    # down (it took them all); skipped: the first and the last.
    assert (exirs_retraces, our_retraces) == (3, 1)
    assert ours == exirs
    # And the program is the quantized module's: two calls against eager.
    method = Runtime.get().load_program(ours).load_method("forward")
    scheme = QUANTIZATIONS["8da4w"]
    for step in range(2):
        x, position = torch.randn(1, 64, generator=torch.Generator().manual_seed(step)), torch.tensor([step])
        (got,) = method.execute([x, position])
        with torch.no_grad():
            expected = module(x, position)
        torch.testing.assert_close(got, expected, rtol=scheme.rtol, atol=scheme.atol)
