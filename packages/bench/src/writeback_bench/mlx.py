"""Decode-step time against cache size: ``python -m writeback_bench.mlx``.

(``--vs-mlx`` runs another benchmark: the delegate against the same models written
by hand in MLX, see :func:`writeback_bench.mlx_vs.run_vs_mlx`.)

One decode step of an attention layer writes one slot of a static K and V cache
``[1, heads, S, head_dim]`` with ``index_copy_`` and attends over a fixed window
of the first ``window`` positions. The window keeps the step's arithmetic the
same at every cache size, so what grows with the cache is only what the
pipeline does with the state: copies back, copies in, failed buffer reuse.
(Attention over the whole cache reads all of it each step, which is O(cache)
for any implementation; that is not what this measures.)

Columns, each the median of ``--steps`` steps after warm-up, run side by side in
one process (every cell is prepared first, then the steps are interleaved across
all cells in a shuffled order, so load from other processes falls on every cell
alike):

- ``stock``: the same step with the caches as registered buffers, lowered by
  stock ``to_edge(...).to_executorch()`` and run by stock ``executorch.runtime``
  (portable kernels; the whole cache is copied back every step).
- ``mlx owned``: caches as buffers the MLX delegate owns (updated by donation).
- ``mlx caller (empty)``: caches owned by the caller, allocated with
  :func:`writeback_mlx_backend.empty`, written in place.
- ``mlx caller (torch)``: the same with plain torch caches, which MLX must copy
  in on every step (what ``writeback explain`` reports as a copy).

The MLX columns call the runtime delegate's ``execute`` on the blob of the
lowered ``.pte`` with the arguments the runtime would pass (the cache tensor as
both input and in-place output); the runtime's own overhead is not included.
"""

from __future__ import annotations

import argparse
import math
import operator
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from writeback_core.quiet import known_warnings_ignored

from writeback_bench.mlx_vs import run_vs_mlx

__all__ = ["WindowDecodeStep", "main"]


class WindowDecodeStep(nn.Module):
    """One attention decode step over a fixed window of a static KV cache.

    ``forward(x, pos)`` with buffer caches, or ``forward(x, pos, k_cache, v_cache)``
    with caller caches; the caches are ``[1, heads, max_seq, head_dim]``.
    """

    def __init__(
        self, max_seq: int, caller_cache: bool, heads: int = 8, head_dim: int = 64, window: int = 64, seed: int = 0
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.window = heads, head_dim, window
        self.max_seq = max_seq
        self.caller_cache = caller_cache
        dim = heads * head_dim
        gen = torch.Generator().manual_seed(seed)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            for layer in (self.wq, self.wk, self.wv, self.wo):
                layer.weight.copy_(torch.randn(dim, dim, generator=gen) / math.sqrt(dim))
        if not caller_cache:
            self.register_buffer("k_cache", torch.zeros(self.cache_shape))
            self.register_buffer("v_cache", torch.zeros(self.cache_shape))

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (1, self.heads, self.max_seq, self.head_dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, *caches: torch.Tensor) -> torch.Tensor:
        if self.caller_cache:
            k_cache, v_cache = caches
        else:
            k_cache, v_cache = self.get_buffer("k_cache"), self.get_buffer("v_cache")
        shape = (1, 1, self.heads, self.head_dim)
        q = self.wq(x).view(shape).transpose(1, 2)
        k_cache.index_copy_(2, pos, self.wk(x).view(shape).transpose(1, 2))
        v_cache.index_copy_(2, pos, self.wv(x).view(shape).transpose(1, 2))
        keys = k_cache[:, :, : self.window]
        values = v_cache[:, :, : self.window]
        visible = torch.arange(self.window).view(1, self.window) <= pos.view(1, 1)
        scores = q @ keys.transpose(2, 3) / math.sqrt(self.head_dim)
        scores = scores + torch.where(visible, 0.0, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(1, 1, self.heads * self.head_dim))
        return projected


def _max_seq(cache_bytes: int, heads: int = 8, head_dim: int = 64) -> int:
    return max(64, cache_bytes // (2 * heads * head_dim * 4))


def _export(module: nn.Module, args: tuple[Any, ...]) -> Any:
    from writeback_core.exporting import export_model

    return export_model(module, args)


def _inputs(step: int, dim: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(1, 1, dim, generator=gen), torch.tensor([step % window])


def _medians_ms(runners: Sequence[Runner], steps: int, warmup: int = 3) -> list[float]:
    """Run every runner once per step, in turn, and return each one's median time."""
    times: list[list[float]] = [[] for _ in runners]
    for step in range(warmup + steps):
        # A fresh order each round, so no cell always follows the same neighbour
        # (a stock step evicts the CPU caches of whatever runs next).
        for index in random.Random(step).sample(range(len(runners)), len(runners)):
            run = runners[index]
            start = time.perf_counter()
            run(step)
            if step >= warmup:
                times[index].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


Runner = Callable[[int], object]


def _stock(max_seq: int, folder: Path) -> Runner:
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    module = WindowDecodeStep(max_seq, caller_cache=False)
    dim = module.heads * module.head_dim
    with known_warnings_ignored():
        pte = to_edge(_export(module, _inputs(0, dim, module.window))).to_executorch().buffer
    path = folder / f"stock_{max_seq}.pte"
    path.write_bytes(pte)
    method = Runtime.get().load_program(path).load_method("forward")
    return lambda step: method.execute(list(_inputs(step, dim, module.window)))


@dataclass
class _Direct:
    """A lowered MLX delegate called the way the runtime calls it."""

    delegate: Any
    handle: Any
    arg_names: list[str]
    outputs: list[torch.Tensor]


def _lower_mlx(module: WindowDecodeStep, args: tuple[Any, ...]) -> _Direct:
    from executorch.exir.delegate import executorch_call_delegate
    from writeback_core import load_registry
    from writeback_core.lowering import lower
    from writeback_mlx_backend.mlx_delegate import MLXDelegate

    registry = load_registry()
    # The one lowering path `writeback run --backend mlx` takes: with writeback-passes
    # installed its passes drop the cache write-backs the delegate accepted.
    program = lower(_export(module, args), registry, registry.backends()["mlx"]).program
    gm = program.exported_program().graph_module
    calls = [n for n in gm.graph.nodes if n.target is executorch_call_delegate]
    others = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target not in (executorch_call_delegate, operator.getitem)
    ]
    if len(calls) != 1 or others:
        raise RuntimeError(f"the step did not lower whole to MLX: {[str(n) for n in others]}")
    lowered = getattr(gm, str(calls[0].args[0].target))
    delegate = MLXDelegate()
    specs = {spec.key: spec.value for spec in lowered.compile_specs}
    handle = delegate.init(bytes(lowered.processed_bytes), specs)
    vals = calls[0].meta["val"]
    outputs = [torch.empty(v.shape, dtype=v.dtype) for v in (vals if isinstance(vals, (list, tuple)) else [vals])]
    return _Direct(delegate, handle, [a.name for a in calls[0].args[1:]], outputs)


def _mlx(max_seq: int, caller: str | None) -> Runner:
    from writeback_mlx_backend.allocations import empty

    module = WindowDecodeStep(max_seq, caller_cache=caller is not None)
    dim = module.heads * module.head_dim
    caches: tuple[torch.Tensor, ...] = ()
    if caller == "empty":
        caches = (empty(module.cache_shape), empty(module.cache_shape))
    elif caller == "torch":
        caches = (torch.zeros(module.cache_shape), torch.zeros(module.cache_shape))
    direct = _lower_mlx(module, (*_inputs(0, dim, module.window), *caches))
    in_place = {c.output: c.input for c in direct.handle.program.in_place}

    def run(step: int) -> None:
        x, pos = _inputs(step, dim, module.window)
        by_name = {"x": x, "pos": pos, **{f"caches_{i}": c for i, c in enumerate(caches)}}
        args = [by_name[name] for name in direct.arg_names]
        outputs = [args[in_place[j]] if j in in_place else t for j, t in enumerate(direct.outputs)]
        direct.delegate.execute(direct.handle, [*args, *outputs])

    return run


def _table(rows: Sequence[tuple[str, list[float]]], columns: Sequence[str]) -> str:
    widths = [max(len(c), 9) for c in columns]
    lines = ["cache     " + "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    for label, values in rows:
        cells = "  ".join(f"{v:{w}.2f}" for v, w in zip(values, widths, strict=True))
        lines.append(f"{label:<10}{cells}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table and the ``time(largest)/time(smallest)`` ratio of each column; with
    ``--vs-mlx``, the delegate against the same models hand-written in MLX instead
    (:func:`run_vs_mlx`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,32,128", help="K+V cache sizes in MiB")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per cell")
    parser.add_argument("--no-stock", action="store_true", help="skip the stock column")
    parser.add_argument(
        "--vs-mlx",
        action="store_true",
        help="the delegate's decode step and idle call against the same models hand-written in MLX",
    )
    parser.add_argument("--cache-mib", type=float, default=8.0, help="--vs-mlx: each model's K+V cache in MiB")
    parser.add_argument("--start", type=int, default=0, help="--vs-mlx: the first decode step (cache position)")
    options = parser.parse_args(argv)
    if options.vs_mlx:
        return run_vs_mlx(options.cache_mib, options.steps, options.start)
    sizes = [int(s) for s in options.sizes.split(",")]
    columns = ["mlx owned", "mlx caller (empty)", "mlx caller (torch)"]
    if not options.no_stock:
        columns.insert(0, "stock")
    runners: list[Runner] = []
    with tempfile.TemporaryDirectory() as folder:
        for mib in sizes:
            max_seq = _max_seq(mib << 20)
            if not options.no_stock:
                runners.append(_stock(max_seq, Path(folder)))
            runners += [_mlx(max_seq, caller) for caller in (None, "empty", "torch")]
            print(f"{mib} MiB lowered", flush=True)
        medians = _medians_ms(runners, options.steps)
    width = len(columns)
    rows = [(f"{mib} MiB", medians[i * width : (i + 1) * width]) for i, mib in enumerate(sizes)]
    print(_table(rows, columns))
    first, last = rows[0][1], rows[-1][1]
    ratios = [b / a for a, b in zip(first, last, strict=True)]
    print(
        f"ratio {rows[-1][0]}/{rows[0][0]}: " + "  ".join(f"{c}={r:.2f}" for c, r in zip(columns, ratios, strict=True))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
