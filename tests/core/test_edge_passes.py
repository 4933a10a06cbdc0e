"""``writeback_core.edge_passes``: exir's transpose and view-op passes are skipped only on a
graph without what they rewrite, and the ``.pte`` is exir's own, byte for byte, and computes
what the eager module does."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.passes import NormalizeTransposePass, ReplaceBrokenOpsWithFunctionalOpsPass
from executorch.runtime import Runtime
from torch import nn
from writeback_core.edge_passes import edge_passes_pruned


class _Transposing(nn.Module):
    """``x @ w.t()`` and a view: the two ops the passes rewrite, before decomposition."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()).view(-1)


def _aten_graph() -> torch.fx.GraphModule:
    """The exported program's ATen graph, ``aten.t`` and ``aten.view`` in it."""
    return torch.export.export(_Transposing(), (torch.randn(2, 4),)).graph_module


def test_the_passes_run_on_a_graph_with_what_they_rewrite_and_return_any_other_unchanged() -> None:
    with_both = _aten_graph()
    targets = {node.target for node in with_both.graph.nodes}
    assert {torch.ops.aten.t.default, torch.ops.aten.view.default} <= targets
    with edge_passes_pruned():
        assert NormalizeTransposePass()(with_both).modified
        assert ReplaceBrokenOpsWithFunctionalOpsPass()(_aten_graph()).modified
        plain = torch.export.export(nn.ReLU(), (torch.randn(3),)).graph_module
        for each in (NormalizeTransposePass(), ReplaceBrokenOpsWithFunctionalOpsPass()):
            result = each(plain)
            assert not result.modified and result.graph_module is plain


def test_lowering_with_the_passes_skipped_writes_exirs_pte_byte_for_byte() -> None:
    torch.manual_seed(0)
    module = _Transposing().eval()
    example = torch.randn(2, 4)
    program = torch.export.export(module, (example,))

    def pte(pruned: bool) -> bytes:
        with edge_passes_pruned() if pruned else nullcontext():
            data: bytes = to_edge_transform_and_lower(program).to_executorch().buffer
        return data

    ours = pte(True)
    assert ours == pte(False)
    (got,) = Runtime.get().load_program(ours).load_method("forward").execute([example])
    with torch.no_grad():
        torch.testing.assert_close(got, module(example))
