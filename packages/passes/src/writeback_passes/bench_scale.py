"""How the early write-back pass scales: ``python -m writeback_passes.bench_scale``.

Builds synthetic exir-shaped graphs (state placeholders, a long chain of aten
ops that read each state directly and through ``view_copy``, one write-back
``copy_`` per state at the end) of about 2,000 and 20,000 nodes, with one state
per 100 nodes, and times :func:`insert_write_back_early` on each, alternating the
two sizes in one process. Prints the medians and their ratio; a near-linear
pass gives about 10. Exits non-zero when the ratio exceeds ``--max-ratio``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.fx

from writeback_passes.early_write_back import insert_write_back_early

__all__ = ["main", "synthetic_graph", "time_pass"]

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


def time_pass(nodes: int) -> tuple[float, int]:
    """Seconds one run of the pass takes on a fresh graph of ``nodes`` nodes, and its size."""
    gm, states = synthetic_graph(nodes)
    size = len(gm.graph.nodes)
    start = time.perf_counter()
    result = insert_write_back_early(gm)
    elapsed = time.perf_counter() - start
    if len(result.placements) != len(states) or not result.modified:
        raise RuntimeError(f"the pass moved {len(result.placements)} of {len(states)} write-backs")
    return elapsed, size


def main(argv: Sequence[str] | None = None) -> int:
    """Print medians for both sizes and the ratio; return 1 when the ratio is over the limit."""
    parser = argparse.ArgumentParser(prog="python -m writeback_passes.bench_scale")
    parser.add_argument("--small", type=int, default=2_000)
    parser.add_argument("--large", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-ratio", type=float, default=12.0)
    args = parser.parse_args(argv)
    small: list[float] = []
    large: list[float] = []
    sizes = (0, 0)
    time_pass(args.small)  # warm up imports and caches outside the measurement
    for _ in range(args.repeats):
        t_small, n_small = time_pass(args.small)
        t_large, n_large = time_pass(args.large)
        small.append(t_small)
        large.append(t_large)
        sizes = (n_small, n_large)
    m_small, m_large = statistics.median(small), statistics.median(large)
    ratio = m_large / m_small
    print(f"{'nodes':>8}{'median ms':>12}")
    print(f"{sizes[0]:>8}{m_small * 1e3:>12.1f}")
    print(f"{sizes[1]:>8}{m_large * 1e3:>12.1f}")
    print(
        f"ratio {ratio:.2f} for {sizes[1] / sizes[0]:.1f}x the nodes "
        f"(limit {args.max_ratio:g}, medians of {args.repeats})"
    )
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
