"""Smoke check of one package installed alone beside writeback-core and the application
(run by .ci/install-alone; writeback-core installs alone).

At whatever versions the environment holds (there: the lowest its pyproject
allows), the package imports without the siblings it does not declare, its plugin
registers, and it does its job once on a small model, all in one process (importing
torch and exir is most of the cost): ``python .ci/smoke-alone.py MODULE``. writeback-core
alone: every contract module imports without click, rich or the application, and finds
a mutation.
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
    "writeback_bench",
]
# What a package may find installed beside it: the workspace packages it declares.
DECLARED = {
    "writeback_bench": [
        "writeback_mlx_backend",
        "writeback_passes",
        "writeback_pybind_runtime",
        "writeback_trt_copyback",
    ],
}
PLUGIN = {
    "writeback": "writeback",
    "writeback_passes": "passes",
    "writeback_mlx_backend": "mlx-backend",
    "writeback_trt_copyback": "trt-copyback",
    "writeback_pybind_runtime": "pybind-runtime",
    "writeback_example_backend": "example-backend",
    "writeback_testing": "writeback-testing",
    "writeback_decoders": "decoders",
    "writeback_bench": "writeback-bench",
}


def writeback(*args: str) -> str:
    """Run the ``writeback`` command in this process; its output, or exit naming it."""
    from writeback.cli import main

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
    import pathlib

    import torch
    import writeback_core

    folder = pathlib.Path(writeback_core.__file__).parent
    for path in sorted(folder.glob("*.py")):
        if path.stem != "__init__":
            importlib.import_module(f"writeback_core.{path.stem}")
    # click may come with executorch's own dependencies; the contract must not import it.
    if importlib.util.find_spec("writeback") is not None:
        raise SystemExit("writeback-core installed alone brought the application")
    imported = sorted(name for name in ("click", "rich", "writeback") if name in sys.modules)
    if imported:
        raise SystemExit(f"importing every contract module imported {imported}")

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count.add_(1)
            return x + self.count

    program = writeback_core.exporting.export_model(Counter(), (torch.ones(1),))
    (mutation,) = writeback_core.find_mutations(program.run_decompositions())
    assert mutation.target == "count", mutation
    assert writeback_core.load_registry().plugin_names() == [], "no plugin is installed beside core"


def application() -> None:
    explain()
    # The benchmarks' commands come with writeback-bench, not with the application alone.
    listed = writeback("--help").split("Commands:")[-1].split()
    if "bench" in listed:
        raise SystemExit(f"`writeback --help` lists bench without writeback-bench installed: {listed}")


def bench() -> None:
    for name in (
        "bench_command",
        "cache_sizes",
        "contenders",
        "llama_scale",
        "model_steps",
        "plots",
        "prefill_attention",
        "runner_generation",
        "mlx",
        "mlx_vs",
        "mlx_vs_calls",
        "mlx_handwritten",
        "passes_memory",
        "passes_scale",
        "pybind",
        "pybind_load",
        "trt",
    ):
        importlib.import_module(f"writeback_bench.{name}")
    from writeback_bench import passes_memory

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        passes_memory.main(["--size", "16"])
    expect(out.getvalue(), "ema")
    expect(writeback("--help"), "bench-generate", "bench-scale")
    expect(writeback("bench", "--help"), "--sizes")


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
    "writeback": application,
    "writeback_bench": bench,
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
    allowed = {module, *DECLARED.get(module, [])}
    present = [s for s in SIBLINGS if s not in allowed and importlib.util.find_spec(s) is not None]
    if present:
        raise SystemExit(f"{module} pulled in siblings: {present}")
    if module != "writeback_core":
        expect(writeback("plugins"), PLUGIN[module])
    SMOKES[module]()


if __name__ == "__main__":
    main(sys.argv[1])
