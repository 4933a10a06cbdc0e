"""Per-call time of this runtime against stock ``executorch.runtime``, side by side.

``python -m writeback_bench.pybind [--calls N] [--cache-mib M]``

Two models, each exported once and run by both runtimes in one process, calls
interleaved (stock, ours, stock, ours, ...) so that machine noise hits both;
medians are printed with the ratio to stock:

1. ``add`` and ``mlp``: no mutation, memory planned as stock exports them; the
   goal is a ratio of at most 1.1. ``add`` is so small that its time is the
   bindings' own per-call cost.
2. ``decoder-caller-cache``: the zoo decoder whose KV cache the caller owns.
   Stock runs the stock export (planned inputs: it copies the cache in every
   call and never updates the caller's tensor). This runtime runs the same
   export (the cache is copied back so it lands in the caller's tensor) and the
   ``alloc_graph_input=False`` export, where the caller's cache is used in place:
   no copy at the boundary, checked by comparing data pointers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from writeback_core.quiet import known_warnings_ignored

__all__ = ["main"]


class _Mlp(torch.nn.Module):
    def __init__(self, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(dim, dim, generator=generator) / dim**0.5) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.weights:
            x = torch.relu(x @ weight)
        return x


def _export(module: torch.nn.Module, args: tuple[Any, ...], planned_inputs: bool) -> bytes:
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.exir.passes import MemoryPlanningPass
    from writeback_core.exporting import export_model

    program = export_model(module, args)
    with known_warnings_ignored():
        config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=planned_inputs))
        return bytes(to_edge(program).to_executorch(config).buffer)


def _interleaved(calls: int, runners: Sequence[Callable[[], Any]]) -> list[float]:
    """Median milliseconds per call of each runner, calls interleaved round-robin."""
    for run in runners:  # warm up: first calls allocate and fault pages in
        run()
        run()
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(calls):
        for k, run in enumerate(runners):
            start = time.perf_counter_ns()
            run()
            times[k].append((time.perf_counter_ns() - start) / 1e6)
    return [statistics.median(t) for t in times]


def _row(case: str, name: str, ms: float, stock_ms: float, note: str = "") -> str:
    return f"{case:<28} {name:<34} {ms:>10.4f} {ms / stock_ms:>7.2f}x  {note}"


class _StockMethod:
    """A stock ``executorch.runtime`` Method with its Program (and bytes) kept alive: a Method
    whose Program was collected reads freed memory."""

    def __init__(self, pte: bytes) -> None:
        from executorch.runtime import Runtime as StockRuntime

        self._pte = pte
        self._program = StockRuntime.get().load_program(pte)
        self._method = self._program.load_method("forward")

    def execute(self, inputs: Any) -> Any:
        return self._method.execute(inputs)


def _stock(pte: bytes) -> _StockMethod:
    return _StockMethod(pte)


def _ours(pte: bytes) -> Any:
    from writeback_core.registry import load_registry
    from writeback_pybind_runtime import Runtime

    return Runtime(load_registry(entry_points=False)).load_program(pte).load_method("forward")


def _bench_mlp(calls: int) -> list[str]:
    x = torch.randn(8, 256)
    pte = _export(_Mlp(), (x,), planned_inputs=True)
    stock, ours = _stock(pte), _ours(pte)
    torch.testing.assert_close(ours([x])[0], stock.execute([x])[0])
    stock_ms, ours_ms = _interleaved(calls, [lambda: stock.execute([x]), lambda: ours([x])])
    return [
        _row("mlp (no mutation)", "stock executorch.runtime", stock_ms, stock_ms),
        _row("mlp (no mutation)", "writeback (goal <= 1.10x)", ours_ms, stock_ms),
    ]


class _Add(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def _bench_add(calls: int) -> list[str]:
    """A model so small that the per-call cost of the bindings is all there is."""
    x, y = torch.randn(4), torch.randn(4)
    pte = _export(_Add(), (x, y), planned_inputs=True)
    stock, ours = _stock(pte), _ours(pte)
    stock_ms, ours_ms = _interleaved(calls * 20, [lambda: stock.execute([x, y]), lambda: ours([x, y])])
    return [
        _row("add (bindings overhead)", "stock executorch.runtime", stock_ms, stock_ms),
        _row("add (bindings overhead)", "writeback", ours_ms, stock_ms),
    ]


def _bench_decoder(calls: int, cache_mib: float) -> list[str]:
    from writeback.zoo import DecoderConfig, decoder_case

    case = decoder_case(DecoderConfig.for_cache_bytes(int(cache_mib * 2**20)), caller_cache=True)
    planned = _export(case.build(), case.example_args(0), planned_inputs=True)
    unplanned = _export(case.build(), case.example_args(0), planned_inputs=False)
    stock, ours_planned, ours_in_place = _stock(planned), _ours(planned), _ours(unplanned)
    inputs = case.step_inputs(3)
    caches = [case.make_state() for _ in range(3)]
    pointers = [c.data_ptr() for c in caches[2]]
    # clone_outputs=False: the mutated cache also comes back as an output, and
    # cloning it would be a copy this runtime does not have to make.
    stock_ms, planned_ms, in_place_ms = _interleaved(
        calls,
        [
            lambda: stock.execute([*inputs, *caches[0]]),
            lambda: ours_planned([*inputs, *caches[1]], clone_outputs=False),
            lambda: ours_in_place([*inputs, *caches[2]], clone_outputs=False),
        ],
    )
    outputs = ours_in_place([*inputs, *caches[2]], clone_outputs=False)
    in_place = all(o.data_ptr() == p for o, p in zip(outputs, pointers, strict=False))
    updated = bool(caches[2][0].abs().sum() > 0) and bool(caches[1][0].abs().sum() > 0)
    label = f"decoder-caller-cache {cache_mib:g} MiB"
    return [
        _row(
            label,
            "stock (cache copied in, not updated)",
            stock_ms,
            stock_ms,
            f"caller cache updated: {bool(caches[0][0].abs().sum() > 0)}",
        ),
        _row(label, "writeback planned (copied back)", planned_ms, stock_ms, f"caller cache updated: {updated}"),
        _row(
            label,
            "writeback alloc_graph_input=False",
            in_place_ms,
            stock_ms,
            f"cache outputs alias the caller's tensors (no copy): {in_place}",
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run both benchmarks and print a table of medians and ratios to stock."""
    parser = argparse.ArgumentParser(
        prog="python -m writeback_bench.pybind", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--calls", type=int, default=50, help="timed calls per runtime")
    parser.add_argument("--cache-mib", type=float, default=8.0, help="K+V cache size of the decoder")
    args = parser.parse_args(argv)
    rows = _bench_add(args.calls) + _bench_mlp(args.calls) + _bench_decoder(args.calls, args.cache_mib)
    print(f"{'case':<28} {'runtime':<34} {'median ms':>10} {'vs stock':>8}")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
