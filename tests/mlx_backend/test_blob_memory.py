"""Loading an MLX ``.pte`` copies its weights once, into MLX arrays: the runtime hands the
delegate its blob as a view of the file's mapping (``processed_as_memoryview``), the
blob's data section is read through that view (no ``bytearray`` copy), and once every
record is an MLX array the view is dropped and the mapping freed. Before, a load held the
blob as ``bytes`` and again as the program's ``bytearray`` (kept for the method's life)
beside the MLX arrays: three copies at the peak, two after."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from writeback_pybind_runtime import Runtime

from tests.mlx_backend.lowering import lower_mlx, registry

SIDE = 4096  # a 64 MiB fp32 weight


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(SIDE, SIDE, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out


def _anon_mib() -> float:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    return int(fields["RssAnon"].split()[0]) / 1024


def test_mlx_load_holds_the_weights_once_and_frees_the_blob_a_cut_file_changes_nothing(tmp_path: Path) -> None:
    """A 64 MiB linear layer lowered to MLX, loaded from its file: the load adds at most
    1.5x the weights of anonymous memory (one MLX copy; the blob kept as bytes and as a
    bytearray added 2x more), the call matches eager, and cutting the file to 0 bytes
    afterwards changes nothing (the MLX arrays own their bytes)."""
    torch.manual_seed(0)
    module = _Linear().eval()
    x = torch.randn(2, SIDE)
    lowered = lower_mlx(module, (x,))
    path = tmp_path / "linear.pte"
    path.write_bytes(lowered.pte)
    weight_mib = SIDE * SIDE * 4 / 2**20
    del lowered
    runtime = Runtime(registry())
    runtime.register_delegates(registry())
    program = runtime.load_program(path)
    before = _anon_mib()
    method = program.load_method("forward")
    added = _anon_mib() - before
    assert added <= 1.5 * weight_mib, f"load added {added:.1f} MiB for {weight_mib:.0f} MiB of weights"
    with torch.no_grad():
        expected = module(x)
    torch.testing.assert_close(method([x])[0], expected, rtol=1e-4, atol=1e-4)
    os.truncate(path, 0)
    torch.testing.assert_close(method([x])[0], expected, rtol=1e-4, atol=1e-4)


def test_a_parsed_blob_reads_its_data_through_a_view_and_refuses_to_grow_changes_nothing() -> None:
    """``DelegateProgram.from_bytes`` keeps a view of the blob's data section (no copy):
    its records read the blob's bytes; adding a tensor to it raises ``TypeError`` and
    leaves it as it was; ``drop_data`` forgets the section."""
    from writeback_mlx_backend.program import DelegateProgram

    from tests.mlx_backend.embedding_cache_blob import EMBEDDING, embedding_cache_program

    blob = embedding_cache_program().to_bytes()
    parsed = DelegateProgram.from_bytes(memoryview(blob))
    assert isinstance(parsed.data, memoryview)
    assert torch.equal(torch.from_numpy(parsed.array(parsed.constants["emb"]).copy()), EMBEDDING)
    size = len(parsed.data)
    with pytest.raises(TypeError, match="read-only: build a new DelegateProgram"):
        parsed.add_tensor(torch.ones(3))
    assert len(parsed.data) == size
    parsed.drop_data()
    assert len(parsed.data) == 0
