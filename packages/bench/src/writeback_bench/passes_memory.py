"""Planned memory, stock ``to_executorch`` vs early write-back: ``python -m writeback_bench.passes_memory``.

For each zoo model, plus a model whose new state is ready at once and followed
by large temporaries, lowers the same edge program both ways and prints the
planned (non-constant) bytes of each, the saving and the bytes of state written
back. Early must never be larger; on the early-ready model it must be smaller
by at least the state's size. Memory plans are deterministic, so each figure is
one lowering, not a median. Exits non-zero when either rule is broken.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from writeback.model_build import export_case
from writeback.zoo import builtin_models
from writeback_core import ModelCase, find_mutations, load_registry
from writeback_core.quiet import known_warnings_ignored

__all__ = ["EarlyReadyState", "MemoryRow", "early_ready_case", "main", "measure"]


class EarlyReadyState(nn.Module):
    """A ``[n, n]`` fp32 state updated first thing, then a chain of ``[n, n]`` matmuls that
    never read it: stock placement keeps the new state alive through all of them."""

    def __init__(self, n: int = 256) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(n, n))
        gen = torch.Generator()
        gen.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(n, n, generator=gen) / n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.get_buffer("state").add_(x)
        h = torch.relu(self.weight @ self.weight)
        h = torch.tanh(h @ self.weight)
        return (h @ self.weight).sum(0)


def early_ready_case(n: int = 256) -> ModelCase:
    """:class:`EarlyReadyState` as a zoo-style case."""

    def inputs(step: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator()
        gen.manual_seed(step)
        return (torch.randn(n, n, generator=gen),)

    return ModelCase(
        name="early-ready",
        description=f"[{n}, {n}] state ready first, then large temporaries",
        build=lambda: EarlyReadyState(n),
        step_inputs=inputs,
    )


@dataclass(frozen=True)
class MemoryRow:
    """Planned bytes of one model lowered both ways, and the bytes of state it writes back."""

    model: str
    stock_bytes: int
    early_bytes: int
    state_bytes: int

    @property
    def saved(self) -> int:
        return self.stock_bytes - self.early_bytes


def measure(case: ModelCase) -> MemoryRow:
    """Lower ``case`` with stock exir and with :func:`writeback_passes.to_executorch`."""
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from writeback_core.copies import CopyLeftWarning
    from writeback_core.lowering import to_executorch
    from writeback_passes.memory_report import memory_plan_report

    with known_warnings_ignored():
        program = export_case(case)
        edge = to_edge(program)
        stock = memory_plan_report(copy.deepcopy(edge).to_executorch())
        # exir's default config on both sides; the copies left are the comparison's subject.
        warnings.filterwarnings("ignore", category=CopyLeftWarning)
        early = memory_plan_report(to_executorch(edge, ExecutorchBackendConfig(), registry=load_registry()))
        state = sum(m.nbytes or 0 for m in find_mutations(program.run_decompositions()))
    return MemoryRow(case.name, stock.total_bytes, early.total_bytes, state)


def _table(rows: Sequence[MemoryRow]) -> str:
    lines = [
        f"{'model':<22}{'stock B':>12}{'early B':>12}{'saved B':>12}{'state B':>12}{'early/stock':>13}",
    ]
    for r in rows:
        ratio = r.early_bytes / r.stock_bytes if r.stock_bytes else 1.0
        lines.append(
            f"{r.model:<22}{r.stock_bytes:>12}{r.early_bytes:>12}{r.saved:>12}{r.state_bytes:>12}{ratio:>13.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; return 1 if early is larger anywhere or saves too little on early-ready."""
    parser = argparse.ArgumentParser(prog="python -m writeback_bench.passes_memory")
    parser.add_argument("--size", type=int, default=256, help="side of the early-ready state")
    args = parser.parse_args(argv)
    cases = [*builtin_models().values(), early_ready_case(args.size)]
    rows = [measure(case) for case in cases]
    print(_table(rows))
    failures = [r for r in rows if r.early_bytes > r.stock_bytes]
    ready = rows[-1]
    if ready.saved < ready.state_bytes:
        failures.append(ready)
    for r in failures:
        print(f"FAIL {r.model}: stock {r.stock_bytes} B, early {r.early_bytes} B", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
