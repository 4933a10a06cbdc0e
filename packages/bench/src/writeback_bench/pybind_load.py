"""Loading a large ``.pte`` from a path: this runtime against stock ``executorch.runtime``.

``python -m writeback_bench.pybind_load [--mib M] [--loads N] [--xnnpack]``

Exports a module whose one parameter holds M MiB (default 128), writes it to a
temporary file, and loads it N times with each runtime, interleaved, the file
already in the page cache. Without ``--xnnpack`` the parameter is a constant of
the portable program, which this runtime reads into memory at ``load_program``;
with it, the module is a linear layer lowered to XNNPACK, whose weight this
runtime reads from the file at ``load_method`` and frees once XNNPACK has packed
it. Stock maps the file. Printed per
runtime: the median time of ``load_program``, the median time from
``load_program`` to the first result, and (Linux) how much anonymous and
file-backed resident memory one loaded program and method hold once it has run,
each measured in a fresh process. A plain
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


def _side(mib: float) -> int:
    return int((mib * 2**20 / 4) ** 0.5)


def _input(mib: float, xnnpack: bool) -> torch.Tensor:
    side = _side(mib)
    return torch.linspace(-1, 1, 4 * side).reshape(4, side) if xnnpack else torch.zeros(4)


class _BigLinear(torch.nn.Module):
    def __init__(self, mib: float) -> None:
        super().__init__()
        side = _side(mib)
        self.linear = torch.nn.Linear(side, side, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(torch.linspace(-1, 1, side * side).reshape(side, side))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out


def _export(module: torch.nn.Module, x: torch.Tensor, xnnpack: bool) -> bytes:
    from executorch.exir import to_edge, to_edge_transform_and_lower
    from writeback_core.program import export_model

    program = export_model(module, (x,))
    with known_warnings_ignored():
        if xnnpack:
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
            return bytes(edge.to_executorch().buffer)
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
        "writeback (file read as asked)": ours.load_program,
        "stock executorch.runtime (file mapped)": stock.load_program,
    }


def _first_result(program: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = program.load_method("forward").execute([x])[0]
    return out


def _print_resident(name: str, path: str, x: torch.Tensor) -> int:
    """In a child process: load ``path`` with runtime ``name``, run it once, print
    how much resident memory that added."""
    load = _runtimes()[name]
    gc.collect()
    before = _resident()
    program = load(path)
    method = program.load_method("forward")
    method.execute([x])
    after = _resident()
    if before is None or after is None:
        print("n/a")
    else:
        print(f"+{after[0] - before[0]:.1f} MiB anon, +{after[1] - before[1]:.1f} MiB file-backed")
    return 0


def _resident_in_child(name: str, path: str, args: argparse.Namespace) -> str:
    """What :func:`_print_resident` prints, from a fresh interpreter (so neither
    runtime reuses memory the other freed)."""
    import subprocess

    command = [sys.executable, "-m", "writeback_bench.pybind_load", "--mib", str(args.mib)]
    command += ["--resident-of", name, "--path", path] + (["--xnnpack"] if args.xnnpack else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    return lines[-1]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print medians and resident memory per runtime."""
    parser = argparse.ArgumentParser(
        prog="python -m writeback_bench.pybind_load", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--mib", type=float, default=128.0, help="size of the module's parameter")
    parser.add_argument("--loads", type=int, default=7, help="timed loads per runtime")
    parser.add_argument("--xnnpack", action="store_true", help="a linear layer lowered to XNNPACK")
    parser.add_argument("--resident-of", help=argparse.SUPPRESS)  # a child's runtime name
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    x = _input(args.mib, args.xnnpack)
    if args.resident_of is not None:
        return _print_resident(args.resident_of, args.path, x)
    module: torch.nn.Module = _BigLinear(args.mib) if args.xnnpack else _Big(args.mib)
    with torch.no_grad():
        expected = module(x)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "big.pte")
        with open(path, "wb") as handle:
            handle.write(_export(module, x, args.xnnpack))
        del module
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
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # summation order
                load_ms[name].append((loaded - start) * 1e3)
                first_ms[name].append((done - start) * 1e3)
                del program
                gc.collect()
            start = time.perf_counter()
            with open(path, "rb") as handle:
                handle.read()
            read_ms.append((time.perf_counter() - start) * 1e3)
        memory = {name: _resident_in_child(name, path, args) for name in runtimes}
    kind = "a linear layer lowered to XNNPACK" if args.xnnpack else "one portable constant"
    print(f"{size_mib:.1f} MiB .pte ({kind}), medians of {args.loads} loads, interleaved")
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
