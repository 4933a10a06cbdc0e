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
    from writeback_mlx_backend.delegate_program import DelegateProgram

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


def test_serializing_a_delegate_program_copies_its_weights_once() -> None:
    """``DelegateProgram.to_bytes`` (what the MLX ``preprocess`` returns) allocates the blob
    once: at 0.5B, an extra ``bytes`` of the data section and a concatenation of it were two
    more copies of the delegated weights at the lowering's peak (``writeback run --backend
    mlx`` 6.80 GB, 2.70x the weights; 6.23 GB, 2.47x, made once). Checked with tracemalloc
    (Python's allocations, where ``bytes`` live) and by reading the blob back."""
    import tracemalloc

    from writeback_mlx_backend.delegate_program import DelegateProgram

    size = 64 * 2**20
    data = bytearray(os.urandom(1 << 16) * (size >> 16))
    program = DelegateProgram(inputs=[], input_meta=[], outputs=[], nodes=[], data=data)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        blob = program.to_bytes()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(blob) > size
    assert peak <= 1.1 * size, f"to_bytes peaked at {peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB data section"
    assert bytes(DelegateProgram.from_bytes(blob).data) == data
