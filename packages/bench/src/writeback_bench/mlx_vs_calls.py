"""What ``python -m writeback_bench.mlx --vs-mlx`` times: the models and each contender's call.

The models are the built-in decoder and ExecuTorch's Llama example, each sized by the K+V
cache it holds, and the idle program ``x + 1``; the timed calls run one of them one step
as eager PyTorch, as the model written by hand in MLX
(:mod:`writeback_bench.mlx_handwritten`) or as writeback's one lowering path with
``--backend mlx`` run by writeback's runtime, each returning the seconds of the work alone
and the step's outputs. :func:`one_core` pins every thread of the process to one CPU for
the rows that measure a call on one core. The rows, the rounds and the tables that use
them are in :mod:`writeback_bench.mlx_vs`.
"""

from __future__ import annotations

import operator
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from writeback_core.quiet import known_warnings_ignored

if TYPE_CHECKING:
    from writeback_core.types import ModelCase

    from writeback_bench.mlx_handwritten import Attend

__all__ = [
    "Timed",
    "can_pin",
    "decoder_case_for",
    "delegate_timed",
    "eager_timed",
    "et_llama_case_for",
    "handwritten_timed",
    "idle_case",
    "one_core",
]

_MIB = 1 << 20

# One call at a step: ``(seconds, outputs)``; the clock covers the work alone, the
# step's inputs are made before it starts.
Timed = Callable[[int], tuple[float, list[Any]]]


class _AddOne(nn.Module):
    """The idle program: one op on a small tensor, so a call costs what calling costs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def decoder_case_for(cache_mib: float) -> ModelCase:
    """The built-in decoder with a K+V cache of ``cache_mib`` MiB."""
    from writeback.zoo import DecoderConfig, decoder_case

    return decoder_case(DecoderConfig.for_cache_bytes(int(cache_mib * _MIB)))


def et_llama_case_for(cache_mib: float, seed: int = 0) -> ModelCase:
    """ExecuTorch's Llama example (``construct_transformer``, KV cache in buffers), sized as
    writeback-decoders sizes it for ``--cache-mib`` (4 layers, 16 heads of 128, dim 128),
    weights drawn from ``seed``, called as ``export_llama`` calls it:
    ``model(tokens, attn_options={"input_pos": pos})``, exported non-strict.

    Step ``s`` feeds token ``(7 s + 3) % vocab`` at position ``s % max_seq`` (a fixed
    sequence rather than greedy decoding: every contender is fed the same tokens).
    """
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs
    from writeback_core.types import ModelCase

    layers, heads, head_dim, vocab = 4, 16, 128, 256
    max_seq = max(8, int(cache_mib * _MIB) // (layers * 2 * heads * head_dim * 4))
    args = ModelArgs(
        dim=128,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=head_dim,
        hidden_dim=256,
        vocab_size=vocab,
        max_batch_size=1,
        max_seq_len=max_seq,
        max_context_len=max_seq,
        use_kv_cache=True,
    )

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module: nn.Module = construct_transformer(args)
        return module.eval().requires_grad_(False)

    return ModelCase(
        name="et-llama",
        description=f"ExecuTorch's Llama example, {layers} layers, dim 128, {max_seq} positions",
        build=build,
        step_inputs=lambda step: (torch.tensor([[(7 * step + 3) % vocab]]),),
        step_kwargs=lambda step: {"attn_options": {"input_pos": torch.tensor([step % max_seq])}},
        strict=False,
    )


def _token_position(case: ModelCase, step: int) -> tuple[int, int]:
    """The step's token and cache position: the first and the last input of both models."""
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves((case.step_inputs(step), case.example_kwargs(step)))
    return int(leaves[0]), int(leaves[-1])


def eager_timed(case: ModelCase) -> Timed:
    """The case's module run by eager PyTorch; the time is the module's call alone."""
    module = case.build().eval().requires_grad_(False)
    state = case.make_state()

    def call(step: int) -> tuple[float, list[Any]]:
        args, kwargs = case.step_inputs(step), case.example_kwargs(step)
        with torch.no_grad():
            start = time.perf_counter()
            out = module(*args, *state, **kwargs)
            seconds = time.perf_counter() - start
        return seconds, [out]

    return call


def handwritten_timed(case: ModelCase, attend: Attend) -> Timed:
    """The case written by hand in MLX, attending as ``attend`` says; the time is its step alone."""
    from writeback_bench.mlx_handwritten import HandwrittenDecoder, HandwrittenETLlama

    module = case.build()
    model = HandwrittenETLlama(module, attend) if case.name == "et-llama" else HandwrittenDecoder(module, attend)

    def call(step: int) -> tuple[float, list[Any]]:
        token, position = _token_position(case, step)
        start = time.perf_counter()
        logits = model.step(token, position)
        return time.perf_counter() - start, [logits]

    return call


def delegate_timed(case: ModelCase, registry: Any) -> tuple[Timed, str]:
    """The case lowered as ``writeback run --backend mlx`` lowers it and run by writeback's
    runtime; the time is the runtime's execute alone. Also returns a note on what stayed
    outside the delegate."""
    from executorch.exir import memory
    from executorch.exir.delegate import executorch_call_delegate
    from writeback.session import Session, assemble, lower_case

    pipeline = assemble(registry, "mlx")
    with known_warnings_ignored():
        lowered = lower_case(case, pipeline)
    session = Session.open(pipeline, lowered)
    graph = lowered.program.exported_program().graph_module.graph
    delegated = sum(1 for n in graph.nodes if n.target is executorch_call_delegate)
    # Ops the runtime runs on its own kernels (the memory planner's allocations are not ops).
    outside = Counter(
        str(getattr(n.target, "__name__", n.target))
        for n in graph.nodes
        if n.op == "call_function" and n.target not in (executorch_call_delegate, operator.getitem, memory.alloc)
    )
    ops = ", ".join(f"{name} x{count}" for name, count in sorted(outside.items())) or "none"
    note = f"{delegated} delegate call(s); ops outside: {ops}; {lowered.copied_per_call} B copied per call"

    def call(step: int) -> tuple[float, list[Any]]:
        result = session.step(step)  # times the runtime's execute alone
        return result.seconds, result.outputs

    return call, note


def idle_case() -> ModelCase:
    """The idle program, ``x + 1`` on 4 floats: a call through it costs what calling costs."""
    from writeback_core.types import ModelCase

    return ModelCase(
        name="idle",
        description="x + 1 on 4 floats",
        build=_AddOne,
        step_inputs=lambda step: (torch.full((4,), float(step)),),
    )


@contextmanager
def one_core() -> Iterator[None]:
    """Every thread of this process (the caller, MLX's stream thread, torch's) on one CPU,
    the lowest this process may use, for the block; each thread's CPUs are restored after.

    MLX on the CPU computes on its stream thread while the caller waits in ``mx.eval``:
    on one core nothing runs less in parallel, and no evaluation waits for a thread to
    wake on another core. Linux only (``/proc/self/task``).
    """
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    cpu = min(os.sched_getaffinity(0))
    before: dict[int, set[int]] = {}
    for thread in threads:
        try:
            before[thread] = os.sched_getaffinity(thread)
            os.sched_setaffinity(thread, {cpu})
        except OSError:  # the thread ended meanwhile
            continue
    try:
        yield
    finally:
        for thread, cpus in before.items():
            try:
                os.sched_setaffinity(thread, cpus)
            except OSError:
                continue


def can_pin() -> bool:
    """Whether :func:`one_core` can pin threads here (Linux: ``sched_setaffinity`` and ``/proc/self/task``)."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")
