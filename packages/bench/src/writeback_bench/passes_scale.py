"""How the early write-back pass scales: ``python -m writeback_bench.passes_scale``.

Builds synthetic exir-shaped graphs (state placeholders, a long chain of aten
ops that read each state directly and through ``view_copy``, one write-back
``copy_`` per state at the end) of about 2,000 and 20,000 nodes, with one state
per 100 nodes, and times :func:`insert_write_back_early` on each, alternating the
two sizes in one process. Prints the medians and their ratio (with and
without the ``GraphModule.recompile`` the pass ends with, which is torch.fx's
code generation), and the ratio of Python function calls, which machine load
cannot blur; a near-linear pass gives about 10. Exits non-zero when the time
ratio exceeds ``--max-ratio``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.fx
from writeback_passes.early_write_back import insert_write_back_early

__all__ = ["count_calls", "main", "synthetic_graph", "time_pass"]

_aten = torch.ops.aten


def synthetic_graph(nodes: int, state_every: int = 100) -> tuple[torch.fx.GraphModule, frozenset[str]]:
    """A graph of about ``nodes`` nodes and the names of its state placeholders.

    Each state is read through a ``view_copy`` at the start of its stretch of the
    chain and by the op computing its new value at the end of it, so every
    write-back moves from the end of the graph to the end of its stretch.
    """
    graph = torch.fx.Graph()
    states = max(1, nodes // state_every)
    placeholders = [graph.placeholder(f"b_state_{i}") for i in range(states)]
    x = graph.placeholder("x")
    per_state = max(4, (nodes - 2 * states - 2) // states - 1)
    current = x
    values = []
    for state in placeholders:
        view = graph.call_function(_aten.view_copy.default, (state, [-1]))
        current = graph.call_function(_aten.add.Tensor, (current, view))
        for step in range(per_state - 3):
            op = _aten.mul.Tensor if step % 2 else _aten.add.Tensor
            current = graph.call_function(op, (current, x))
        values.append(graph.call_function(_aten.sub.Tensor, (current, state)))
    copies = [graph.call_function(_aten.copy_.default, (s, v)) for s, v in zip(placeholders, values, strict=True)]
    graph.output((*copies, current))
    return torch.fx.GraphModule(torch.nn.Module(), graph), frozenset(p.name for p in placeholders)


def time_pass(nodes: int) -> tuple[float, float, int]:
    """Seconds one run of the pass takes on a fresh graph of ``nodes`` nodes, the part of it
    spent in ``GraphModule.recompile`` (torch.fx code generation), and the graph's size.

    The collector is paused while timing: a collection triggered by the big graph
    would otherwise land in one run or another at random.
    """
    gm, states = synthetic_graph(nodes)
    size = len(gm.graph.nodes)
    recompile = type(gm).recompile
    spent = [0.0]

    def timed_recompile(self: torch.fx.GraphModule) -> object:
        begin = time.perf_counter()
        try:
            return recompile(self)
        finally:
            spent[0] += time.perf_counter() - begin

    gm.recompile = timed_recompile.__get__(gm)  # type: ignore[method-assign]  # measure, not change
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        result = insert_write_back_early(gm)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    if len(result.placements) != len(states) or not result.modified:
        raise RuntimeError(f"the pass moved {len(result.placements)} of {len(states)} write-backs")
    return elapsed, spent[0], size


def count_calls(nodes: int) -> int:
    """Python function calls one run of the pass makes (recompile included): a measure of
    work that machine load cannot blur, to read beside the timings."""
    gm, _ = synthetic_graph(nodes)
    calls = [0]

    def profile(frame: object, event: str, arg: object) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    sys.setprofile(profile)
    try:
        insert_write_back_early(gm)
    finally:
        sys.setprofile(None)
    return calls[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Print medians for both sizes and the ratio; return 1 when the ratio is over the limit."""
    parser = argparse.ArgumentParser(prog="python -m writeback_bench.passes_scale")
    parser.add_argument("--small", type=int, default=2_000)
    parser.add_argument("--large", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-ratio", type=float, default=12.0)
    args = parser.parse_args(argv)
    runs: dict[int, list[tuple[float, float]]] = {args.small: [], args.large: []}
    sizes: dict[int, int] = {}
    time_pass(args.small)  # warm up imports and caches outside the measurement
    for _ in range(args.repeats):
        for nodes in (args.small, args.large):
            total, recompile, sizes[nodes] = time_pass(nodes)
            runs[nodes].append((total, recompile))
    medians = {n: (statistics.median(t for t, _ in r), statistics.median(t - c for t, c in r)) for n, r in runs.items()}
    print(f"{'nodes':>8}{'pass ms':>12}{'without recompile ms':>24}")
    for nodes, (total, own) in medians.items():
        print(f"{sizes[nodes]:>8}{total * 1e3:>12.1f}{own * 1e3:>24.1f}")
    ratio = medians[args.large][0] / medians[args.small][0]
    own_ratio = medians[args.large][1] / medians[args.small][1]
    print(
        f"ratio {ratio:.2f} ({own_ratio:.2f} without torch.fx recompile) for "
        f"{sizes[args.large] / sizes[args.small]:.1f}x the nodes (limit {args.max_ratio:g}, medians of {args.repeats})"
    )
    work = count_calls(args.large) / count_calls(args.small)
    print(f"function calls ratio {work:.2f} (deterministic)")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
