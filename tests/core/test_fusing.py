"""``writeback_core.fusing``: while exir fuses the partitions XNNPACK takes, the program's code
is generated once, not once per partition, and the ``.pte`` is the one exir makes without the
change, byte for byte, and computes what the eager module does."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from executorch.exir.backend import backend_api
from executorch.runtime import Runtime
from torch import nn
from torch.export import ExportedProgram
from writeback.session import assemble
from writeback_core import lowering
from writeback_core.exporting import export_model
from writeback_core.registry import load_registry


class _ThreeProjections(nn.Module):
    """Three projections with a cache write between each: the writes stay outside XNNPACK, so
    it takes three partitions."""

    cache: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(4, 16))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, position, self.first(x))
        middle = self.second(self.cache)
        self.cache.index_copy_(0, position + 1, middle[:1])
        out: torch.Tensor = self.third(self.cache)
        return out


def _lower(exported: ExportedProgram, monkeypatch: pytest.MonkeyPatch, *, once: bool) -> tuple[bytes, int, int]:
    """The ``.pte``, how many times the program's code was generated while exir fused its
    partitions, and how many partitions it fused; ``once=False``: exir's own fusing."""
    fusing = [False]
    generated: list[int] = []
    fused: list[int] = []
    real_fuse = backend_api._create_partitions_in_graph_module
    real_recompile = torch.fx.GraphModule.recompile

    def fuse(*args: Any, **kwargs: Any) -> Any:
        fusing[0] = True
        try:
            result = real_fuse(*args, **kwargs)
        finally:
            fusing[0] = False
        fused.append(sum(len(nodes) for nodes in result.values()))
        return result

    def recompile(self: torch.fx.GraphModule) -> Any:
        if fusing[0] and any(name.startswith("fused_") for name, _ in self.named_children()):
            generated.append(1)
        return real_recompile(self)

    with monkeypatch.context() as patch:
        patch.setattr(backend_api, "_create_partitions_in_graph_module", fuse)
        patch.setattr(torch.fx.GraphModule, "recompile", recompile)
        if not once:
            patch.setattr(lowering, "code_generated_once", nullcontext)
        pipeline = assemble(load_registry(), "xnnpack")
        lowered = lowering.lower(exported, pipeline.registry, pipeline.backend)
    return lowered.pte, len(generated), sum(fused)


def test_fusing_xnnpack_s_partitions_generates_the_code_once_and_writes_exirs_pte_byte_for_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    module = _ThreeProjections().eval()
    exported = export_model(module, (torch.randn(1, 16), torch.tensor([1])))
    exirs, exirs_generated, partitions = _lower(exported, monkeypatch, once=False)
    ours, our_generated, _ = _lower(exported, monkeypatch, once=True)
    assert partitions == 3
    # exir: once per partition fused; here: none while fusing (once, right after).
    assert (exirs_generated, our_generated) == (3, 0)
    assert ours == exirs
    method = Runtime.get().load_program(ours).load_method("forward")
    x, position = torch.randn(1, 16), torch.tensor([1])
    (got,) = method.execute([x, position])
    with torch.no_grad():
        expected = _ThreeProjections().eval()
        expected.load_state_dict(module.state_dict())
        want = expected(x, position)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
