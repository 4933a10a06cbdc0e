"""``writeback explain``'s "mlx" column states the rule the pipeline applies: for each
mutation, the column says in place exactly when core records MLX's acceptance.

Hazard from the review: a buffer whose new value is also returned was declined by
``writeback_accepts_in_place`` while the column said "delegate-owned, in place".
"""

from __future__ import annotations

import torch
from executorch.exir import to_edge_transform_and_lower
from writeback_core import annotating, find_mutations

from tests.mlx_backend.lowering import export_module, registry


class ReturnsItsCache(torch.nn.Module):
    """``cache[pos] = x``, and the cache's new value is also what the model returns."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(64, 16))
        self.register_buffer("kept", torch.zeros(64, 16))

    def forward(self, pos: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.index_copy_(0, pos, x)
        self.kept.index_copy_(0, pos, x * 2.0)
        return self.cache, self.kept.sum(0)


def test_buffer_also_returned_is_copied_back_in_explain_as_in_the_pipeline() -> None:
    reg = registry()
    args = (torch.tensor([1]), torch.ones(1, 16))
    program = export_module(ReturnsItsCache(), args)

    # What the pipeline records: the backend's partitioner, wrapped by core.
    partitioner = annotating(reg.backends()["mlx"].partitioner(reg), "mlx", reg)
    edge = to_edge_transform_and_lower(program, partitioner=[partitioner])
    # (An owned buffer's placeholder moves into the delegate, so read the decisions made.)
    accepted = {d.target: d.accepted for d in partitioner.decisions}
    # Worked out by hand: "cache" is returned, so its new value must live outside it.
    assert accepted == {"cache": False, "kept": True}

    # What explain shows, asked as the CLI asks (the exported program, decomposed mutations).
    columns = {
        m.target: reg.hook.writeback_explain_columns(program=program, mutation=m)
        for m in find_mutations(program.run_decompositions())
    }
    mlx = {t: next(c["mlx"] for c in found if "mlx" in c) for t, found in columns.items()}
    assert (
        mlx["cache"] == "copied back, 4.0 KiB/call: its new value is also returned, which must live outside the buffer"
    )
    assert mlx["kept"] == "delegate-owned, in place"

    # And the program computes what eager does.
    eager = ReturnsItsCache().eval()
    with torch.no_grad():
        expected = eager(*args)
    got = edge.exported_program().module()(*args)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
