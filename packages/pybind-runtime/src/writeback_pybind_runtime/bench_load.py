"""Loading a large ``.pte`` from a path: this runtime against stock ``executorch.runtime``.

``python -m writeback_pybind_runtime.bench_load [--mib M] [--loads N]``

Exports a module whose one parameter holds M MiB (default 128), writes it to a
temporary file, and loads it N times with each runtime, interleaved, the file
already in the page cache. This runtime reads the file into memory the program
owns (so the file may then change or vanish); stock maps it. Printed per
runtime: the median time of ``load_program``, the median time from
``load_program`` to the first result, and (Linux) how much anonymous and
file-backed resident memory one loaded program holds once it has run. A plain
``open(path, "rb").read()`` of the file is timed as a reference.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from writeback_core.quiet import known_warnings_ignored

__all__ = ["main"]


class _Big(torch.nn.Module):
    def __init__(self, mib: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0, 1, int(mib * 2**20) // 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight.sum()


def _export(module: torch.nn.Module) -> bytes:
    from executorch.exir import to_edge
    from writeback_core.lowering import export_model

    program = export_model(module, (torch.zeros(4),))
    with known_warnings_ignored():
        return bytes(to_edge(program).to_executorch().buffer)


def _resident() -> tuple[float, float] | None:
    """(anonymous, file-backed) resident MiB of this process, or None off Linux."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
    except OSError:
        return None
    return int(fields["RssAnon"].split()[0]) / 1024, int(fields["RssFile"].split()[0]) / 1024


def _runtimes() -> dict[str, Callable[[str], Any]]:
    from executorch.runtime import Runtime as StockRuntime
    from writeback_core.registry import load_registry

    from writeback_pybind_runtime import Runtime

    ours = Runtime(load_registry(entry_points=False))
    stock = StockRuntime.get()
    return {
        "writeback (file read in)": ours.load_program,
        "stock executorch.runtime (file mapped)": stock.load_program,
    }


def _first_result(program: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = program.load_method("forward").execute([x])[0]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print medians and resident memory per runtime."""
    parser = argparse.ArgumentParser(
        prog="python -m writeback_pybind_runtime.bench_load", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--mib", type=float, default=128.0, help="size of the module's parameter")
    parser.add_argument("--loads", type=int, default=7, help="timed loads per runtime")
    args = parser.parse_args(argv)
    module = _Big(args.mib)
    with torch.no_grad():
        expected = module(torch.zeros(4))
    x = torch.zeros(4)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "big.pte")
        with open(path, "wb") as handle:
            handle.write(_export(module))
        size_mib = os.path.getsize(path) / 2**20
        runtimes = _runtimes()
        with open(path, "rb") as handle:
            handle.read()  # page cache warm for everyone
        load_ms: dict[str, list[float]] = {name: [] for name in runtimes}
        first_ms: dict[str, list[float]] = {name: [] for name in runtimes}
        read_ms: list[float] = []
        for _ in range(args.loads):
            for name, load in runtimes.items():
                start = time.perf_counter()
                program = load(path)
                loaded = time.perf_counter()
                out = _first_result(program, x)
                done = time.perf_counter()
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=0.0)  # summation order
                load_ms[name].append((loaded - start) * 1e3)
                first_ms[name].append((done - start) * 1e3)
                del program
                gc.collect()
            start = time.perf_counter()
            with open(path, "rb") as handle:
                handle.read()
            read_ms.append((time.perf_counter() - start) * 1e3)
        memory: dict[str, str] = {}
        for name, load in runtimes.items():
            gc.collect()
            before = _resident()
            program = load(path)
            _first_result(program, x)
            after = _resident()
            if before is None or after is None:
                memory[name] = "n/a"
            else:
                memory[name] = f"+{after[0] - before[0]:.1f} MiB anon, +{after[1] - before[1]:.1f} MiB file-backed"
            del program
    print(f"{size_mib:.1f} MiB .pte, medians of {args.loads} loads, interleaved")
    print(f"{'runtime':<40} {'load_program ms':>16} {'to first result ms':>19}  resident after one call")
    for name in runtimes:
        print(
            f"{name:<40} {statistics.median(load_ms[name]):>16.2f} "
            f"{statistics.median(first_ms[name]):>19.2f}  {memory[name]}"
        )
    print(f"{'open(path).read() (reference)':<40} {statistics.median(read_ms):>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
