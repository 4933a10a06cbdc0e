"""Smoke check of one package installed alone beside writeback-core (run by .ci/install-alone).

At whatever versions the environment holds (there: the lowest its pyproject
allows), the package imports without its siblings, its plugin registers, and
it does its job once on a small model, all in one process (importing torch and
exir is most of the cost): ``python .ci/smoke-alone.py MODULE``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SIBLINGS = [
    "writeback_passes",
    "writeback_mlx_backend",
    "writeback_trt_copyback",
    "writeback_pybind_runtime",
    "writeback_example_backend",
    "writeback_testing",
    "writeback_decoders",
]
PLUGIN = {
    "writeback_core": "writeback-core",
    "writeback_passes": "passes",
    "writeback_mlx_backend": "mlx-backend",
    "writeback_trt_copyback": "trt-copyback",
    "writeback_pybind_runtime": "pybind-runtime",
    "writeback_example_backend": "example-backend",
    "writeback_testing": "writeback-testing",
    "writeback_decoders": "decoders",
}


def writeback(*args: str) -> str:
    """Run the ``writeback`` command in this process; its output, or exit naming it."""
    from writeback_core.cli import main

    out = io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main([*args], prog_name="writeback")
        except SystemExit as exit_:
            code = exit_.code
    if code not in (0, None):
        raise SystemExit(f"`writeback {' '.join(args)}` exited {code}:\n{out.getvalue()}")
    return out.getvalue()


def expect(text: str, *needles: str) -> None:
    missing = [n for n in needles if n not in text]
    if missing:
        raise SystemExit(f"expected {missing} in:\n{text}")


def explain(*rows: str) -> None:
    expect(writeback("explain", "ema"), "stock write-back", *rows)


def core() -> None:
    explain()


def testing() -> None:
    expect(writeback("fuzz", "--programs", "2", "--seed", "1", "--jobs", "1"), "0 mismatches")


def passes() -> None:
    explain("early write-back")


def trt_copyback() -> None:
    explain("trt engine")


def pybind_runtime() -> None:
    expect(writeback("run", "ema", "--backend", "none", "--steps", "2"), "all 2 steps match eager")


def _delegated_blob(partitioner: object) -> tuple[bytes, torch.nn.Module]:
    """Lower a one-row cache update with ``partitioner``; the delegate's blob and a fresh eager twin."""
    import torch
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    class RowCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(8, 4))

        def forward(self, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
            self.cache.index_copy_(0, pos, row)
            return self.cache.sum(0)

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.export.export(RowCache().eval(), (torch.tensor([0]), torch.ones(1, 4)), strict=False)
        edge = to_edge_transform_and_lower(program, partitioner=[partitioner])
    (lowered,) = [m for m in edge.exported_program().graph_module.children() if isinstance(m, LoweredBackendModule)]
    return bytes(lowered.processed_bytes), RowCache().eval()


def mlx_backend() -> None:
    import torch
    from writeback_core import annotating
    from writeback_core.registry import load_registry
    from writeback_mlx_backend import MLXDelegate, MLXPartitioner, empty

    explain("mlx")
    blob, eager = _delegated_blob(annotating(MLXPartitioner(), "mlx", load_registry()))
    delegate = MLXDelegate()
    handle = delegate.init(blob, {})
    for step in range(3):
        pos, row = torch.tensor([step * 3]), torch.full((1, 4), step + 1.0)
        out = torch.empty(4)
        delegate.execute(handle, [pos, row, out])
        with torch.no_grad():
            torch.testing.assert_close(out, eager(pos, row))
    cache = empty((2, 4))
    cache[1].fill_(3.0)
    assert float(cache.sum()) == 12.0


def example_backend() -> None:
    from writeback_example_backend.backend import ExamplePartitioner

    blob, _ = _delegated_blob(ExamplePartitioner())
    assert blob


def decoders() -> None:
    # Installed with its `hf` extra (install-alone installs a package's extras): every model is offered.
    # Four states: explain prints one column each, their names cut to fit.
    expect(writeback("explain", "et-llama"), "layers.0.attention", "index_copy(dim=2", "stock write-back")
    expect(writeback("explain", "hf-llama"), "key_cache_0", "stock write-back")


SMOKES: dict[str, Callable[[], None]] = {
    "writeback_core": core,
    "writeback_passes": passes,
    "writeback_mlx_backend": mlx_backend,
    "writeback_trt_copyback": trt_copyback,
    "writeback_pybind_runtime": pybind_runtime,
    "writeback_example_backend": example_backend,
    "writeback_testing": testing,
    "writeback_decoders": decoders,
}


def main(module: str) -> None:
    importlib.import_module(module)
    present = [s for s in SIBLINGS if s != module and importlib.util.find_spec(s) is not None]
    if present:
        raise SystemExit(f"{module} pulled in siblings: {present}")
    expect(writeback("plugins"), PLUGIN[module])
    SMOKES[module]()


if __name__ == "__main__":
    main(sys.argv[1])
