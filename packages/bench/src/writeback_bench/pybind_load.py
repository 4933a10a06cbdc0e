"""Loading a large ``.pte`` from a path: this runtime against stock ``executorch.runtime``.

``python -m writeback_bench.pybind_load [--mib M] [--loads N] [--xnnpack | --pte PATH]``

Exports a module whose one parameter holds M MiB (default 128), writes it to a
temporary file, and loads it N times with each runtime, interleaved in this
process, the file already in the page cache. Without ``--xnnpack`` the parameter
is a constant of the portable program, which this runtime maps from the file at
``load_program`` from 8 MiB on (reads below); with it, the module is a linear layer lowered to XNNPACK, whose
weight this runtime maps from the file at ``load_method`` for XNNPACK to pack
(then unmaps it). ``--pte PATH`` loads that file instead (method ``forward``,
not run; the LLM runner's kernels registered first, for the programs
``writeback export`` and ``bench-scale`` write). Stock maps the file. Printed per
runtime: the medians of ``load_program`` and of ``load_program`` +
``load_method`` (load), load as a multiple of stock's, the median time from
``load_program`` to the first result, and (Linux) how much anonymous and
file-backed resident memory one loaded program and method hold once it has run
(``--pte``: once it has loaded), each measured in a fresh process. A plain
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
from dataclasses import dataclass, field
from typing import Any

import torch
from writeback_core.quiet import known_warnings_ignored

__all__ = ["main"]


class _Big(torch.nn.Module):
    def __init__(self, mib: float) -> None:
        super().__init__()
        # +1, -1, +1, ... (first 3): every partial sum is exact in fp32, so a kernel that
        # sums in order and eager's pairwise sum agree at any size (a ramp's order-dependent
        # rounding reached 4% at 64 MiB).
        weight = torch.ones(int(mib * 2**20) // 4)
        weight[1::2] = -1
        weight[0] = 3
        self.weight = torch.nn.Parameter(weight)

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
    from writeback_core.exporting import export_model

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


OURS = "writeback (mapped; small constants read)"
STOCK = "stock executorch.runtime (file mapped)"


def _runtimes() -> dict[str, Callable[[str], Any]]:
    from executorch.runtime import Runtime as StockRuntime
    from writeback_core.registry import load_registry
    from writeback_pybind_runtime import Runtime

    ours = Runtime(load_registry(entry_points=False))
    stock = StockRuntime.get()
    return {OURS: ours.load_program, STOCK: stock.load_program}


def _print_resident(name: str, path: str, x: torch.Tensor | None) -> int:
    """In a child process: load ``path`` with runtime ``name``, run it once (unless
    ``x`` is None), print how much resident memory that added."""
    load = _runtimes()[name]
    gc.collect()
    before = _resident()
    program = load(path)
    method = program.load_method("forward")
    if x is not None:
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
    command += ["--resident-of", name, "--path", path]
    command += ["--xnnpack"] if args.xnnpack else []
    command += ["--pte", args.pte] if args.pte else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    return lines[-1]


def _export_to(folder: str, args: argparse.Namespace, x: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The benchmark's module exported into ``folder``, and its first result in eager."""
    module: torch.nn.Module = _BigLinear(args.mib) if args.xnnpack else _Big(args.mib)
    with torch.no_grad():
        expected = module(x)
    path = os.path.join(folder, "big.pte")
    with open(path, "wb") as handle:
        handle.write(_export(module, x, args.xnnpack))
    return path, expected


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


@dataclass
class _Times:
    """One runtime's timed loads, in seconds."""

    program: list[float] = field(default_factory=list)  # load_program
    load: list[float] = field(default_factory=list)  # load_program + load_method
    first: list[float] = field(default_factory=list)  # to the first result (when run)


def _time_loads(
    runtimes: dict[str, Callable[[str], Any]], path: str, x: torch.Tensor | None, expected: Any, loads: int
) -> tuple[dict[str, _Times], list[float]]:
    """``loads`` rounds, each loading ``path`` once per runtime (and running it on ``x``
    unless None), then reading the file once: each runtime's times and the reads' times."""
    times = {name: _Times() for name in runtimes}
    reads: list[float] = []
    for _ in range(loads):
        for name, load in runtimes.items():
            start = time.perf_counter()
            program = load(path)
            times[name].program.append(time.perf_counter() - start)
            method = program.load_method("forward")
            times[name].load.append(time.perf_counter() - start)
            if x is not None:
                out = method.execute([x])[0]
                times[name].first.append(time.perf_counter() - start)
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # summation order
            del program, method
            gc.collect()
        start = time.perf_counter()
        with open(path, "rb") as handle:
            handle.read()
        reads.append(time.perf_counter() - start)
    return times, reads


def _table(times: dict[str, _Times], memory: dict[str, str], after: str) -> list[str]:
    header = f"{'runtime':<42} {'load_program ms':>16} {'load ms':>9} {'x stock':>8} {'to first result ms':>19}"
    lines = [f"{header}  {after}"]
    stock_load = _median_ms(times[STOCK].load)
    for name, taken in times.items():
        first = f"{_median_ms(taken.first):>19.2f}" if taken.first else f"{'-':>19}"
        lines.append(
            f"{name:<42} {_median_ms(taken.program):>16.2f} {_median_ms(taken.load):>9.2f} "
            f"{_median_ms(taken.load) / stock_load:>7.2f}x {first}  {memory[name]}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print medians, ratios to stock and resident memory per runtime."""
    parser = argparse.ArgumentParser(
        prog="python -m writeback_bench.pybind_load", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--mib", type=float, default=128.0, help="size of the module's parameter")
    parser.add_argument("--loads", type=int, default=7, help="timed loads per runtime")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--xnnpack", action="store_true", help="a linear layer lowered to XNNPACK")
    kind.add_argument("--pte", help="load this .pte (its method 'forward') instead of exporting one")
    parser.add_argument("--resident-of", help=argparse.SUPPRESS)  # a child's runtime name
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pte:
        from writeback_core.llm_runner import load_runner_kernels

        load_runner_kernels()
    x = None if args.pte else _input(args.mib, args.xnnpack)
    if args.resident_of is not None:
        return _print_resident(args.resident_of, args.path, x)
    with tempfile.TemporaryDirectory() as folder:
        path, expected = (args.pte, None) if x is None else _export_to(folder, args, x)
        size_mib = os.path.getsize(path) / 2**20
        runtimes = _runtimes()
        with open(path, "rb") as handle:
            handle.read()  # page cache warm for everyone
        times, reads = _time_loads(runtimes, path, x, expected, args.loads)
        memory = {name: _resident_in_child(name, path, args) for name in runtimes}
    if args.pte:
        kind_words = os.path.basename(args.pte)
    else:
        kind_words = "a linear layer lowered to XNNPACK" if args.xnnpack else "one portable constant"
    print(f"{size_mib:.1f} MiB .pte ({kind_words}), medians of {args.loads} loads, interleaved")
    for line in _table(times, memory, "resident after load" if x is None else "resident after one call"):
        print(line)
    print(f"{'open(path).read() (reference)':<42} {_median_ms(reads):>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
