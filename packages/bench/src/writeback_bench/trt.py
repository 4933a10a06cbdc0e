"""``python -m writeback_bench.trt``: what copy-back costs against engine aliasing.

One decode step over a ``[1, 8, S, 64]`` fp32 KV cache (one slot written with
``index_copy_``, then attention reads the cache), lowered to the kv-alias
engine twice, run side by side in one process by the first runtime a plugin
offers (``writeback_runtimes``, e.g. the pybind-runtime):

- aliased: the default (TensorRT) rule; the engine writes the slot in place;
- copy-back: the same engine with a rule that refuses the write (``seq_dim``
  pointed elsewhere), so the program copies the whole new cache back each call.

Prints the median step time of each and their ratio per cache size.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from collections.abc import Sequence

import torch
from torch import nn
from writeback_core.exporting import export_model
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import Registry, load_registry
from writeback_core.types import RuntimeMethod, RuntimeSpec
from writeback_trt_copyback.compile import CompiledProgram, compile_for_engine
from writeback_trt_copyback.declare import UninitializedCopyBackWarning
from writeback_trt_copyback.engine import KVAliasEngine
from writeback_trt_copyback.rule import TensorRTCacheRule

__all__ = ["main"]

HEADS, HEAD_DIM = 8, 64


class _Step(nn.Module):
    k_cache: torch.Tensor

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, HEADS, slots, HEAD_DIM))

    def forward(self, k: torch.Tensor, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k_cache.index_copy_(2, pos, k)
        return (q @ self.k_cache.transpose(2, 3)).amax(-1) / math.sqrt(HEAD_DIM)


def _time_steps(methods: dict[str, RuntimeMethod], slots: int, steps: int) -> dict[str, float]:
    """Median ms per call of each method, calls interleaved so both see the same load."""
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for step in range(steps):
        args = [
            torch.randn(1, HEADS, 1, HEAD_DIM, generator=gen),
            torch.randn(1, HEADS, 1, HEAD_DIM, generator=gen),
            torch.tensor([step % slots]),
        ]
        order = list(methods) if step % 2 else list(reversed(methods))
        for name in order:
            start = time.perf_counter()
            methods[name].execute(args)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}


def _load(program: CompiledProgram, runtime: RuntimeSpec, registry: Registry) -> RuntimeMethod:
    et = program.to_executorch()
    loaded = runtime.load_program(bytes(et.buffer), registry.runtime_delegates())
    return loaded.load_method("forward")


def main(argv: Sequence[str] | None = None) -> None:
    """Print aliased vs copy-back step times (medians) for each cache size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--mib", type=int, nargs="+", default=[1, 8, 32], help="KV cache sizes in MiB (default: 1 8 32)"
    )
    parser.add_argument("--steps", type=int, default=25, help="timed steps per program")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared machine, more "
        "threads spin against each other and swamp the difference)",
    )
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    registry = load_registry()
    runtimes = registry.runtimes()
    if not runtimes:
        raise SystemExit("no runtime offered (writeback_runtimes): install writeback-pybind-runtime")
    runtime = runtimes[sorted(runtimes)[0]]
    engines = {"aliased": KVAliasEngine(), "copy-back": KVAliasEngine(rule=TensorRTCacheRule(seq_dim=1))}
    print(
        f"runtime: {runtime.name}; median of {options.steps - 1} interleaved steps; "
        f"one slot written per step; {options.threads} torch thread(s)"
    )
    print(f"{'cache':>8} {'aliased ms':>11} {'copy-back ms':>13} {'copy-back/aliased':>18}")
    for mib in options.mib:
        slots = mib * 2**20 // (HEADS * HEAD_DIM * 4)
        args = (torch.zeros(1, HEADS, 1, HEAD_DIM), torch.zeros(1, HEADS, 1, HEAD_DIM), torch.tensor([0]))
        program = export_model(_Step(slots), args)
        with known_warnings_ignored(), warnings.catch_warnings():
            # The bench's cache starts at zeros, which the runtime zero-fills: nothing to initialise.
            warnings.simplefilter("ignore", UninitializedCopyBackWarning)
            methods = {
                name: _load(compile_for_engine(program, engine), runtime, registry) for name, engine in engines.items()
            }
        ms = _time_steps(methods, slots, options.steps)
        ratio = ms["copy-back"] / ms["aliased"]
        print(f"{mib:>5} MiB {ms['aliased']:>11.3f} {ms['copy-back']:>13.3f} {ratio:>17.1f}x")


if __name__ == "__main__":
    main()
