"""``python -m writeback_bench.prefill_attention [MODEL] [--cache-mib M]``: a model's prompt
prefilled in one call, then decode steps, in stock ``executorch.runtime``, interleaved in one
process on one thread.

Rows: ``writeback+xnnpack`` (what ``writeback export`` writes), the same without the
``runner_attention`` pass (attention bounded to the written keys by ``bound_attention``),
without both (attention over the whole cache), and ``stock+xnnpack`` of each of the model's
contenders (for ``et-llama``: ExecuTorch's custom KV-cache and SDPA ops). The
model is its ``dynamic_prefill`` form. Prints medians and each row's time over
``writeback+xnnpack``'s (above 1: slower than writeback).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from writeback_core.registry import Registry, load_registry
from writeback_core.types import ProgramPass, Stage

__all__ = ["main"]

LEFT_OUT: tuple[tuple[str, ...], ...] = (("runner_attention",), ("runner_attention", "bound_attention"))


class _WithoutPasses(Registry):
    """``base`` with some program passes left out."""

    def __init__(self, base: Registry, names: tuple[str, ...]) -> None:
        self.__dict__.update(base.__dict__)
        self._left_out = names

    def program_passes(self, stage: Stage, backend: str | None) -> list[ProgramPass]:
        return [p for p in super().program_passes(stage, backend) if p.name not in self._left_out]


def main(argv: list[str] | None = None) -> None:
    import torch
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime
    from writeback.cli import resolve_model_option
    from writeback.model_build import export_case
    from writeback_core.llm_runner import load_runner_kernels
    from writeback_core.lowering import lower

    from writeback_bench.contenders import stock_program

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="et-llama")
    parser.add_argument("--cache-mib", type=float, default=32.0)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    portable_lib._unsafe_reset_threadpool(1)
    load_runner_kernels()
    registry = load_registry()
    case = resolve_model_option(registry, args.model)
    if case.sized is not None:
        case = case.sized(args.cache_mib)
    if case.dynamic_prefill is None:
        raise SystemExit(f"model {case.name!r} has no dynamic-prefill form")
    case = case.dynamic_prefill()
    backend = registry.backends()["xnnpack"]
    ptes = {"writeback+xnnpack": lower(export_case(case), registry, backend, "state", case).pte}
    for left_out in LEFT_OUT:
        without = _WithoutPasses(registry, left_out)
        ptes[f"writeback+xnnpack without {', '.join(left_out)}"] = lower(
            export_case(case), without, backend, "state", case
        ).pte
    for label, make in case.contenders.items():
        ptes[f"stock+xnnpack ({label})"] = bytes(stock_program(make(), xnnpack=True).buffer)
    runtime = Runtime.get()
    methods = {name: runtime.load_program(pte).load_method("forward") for name, pte in ptes.items()}
    vocab = int(case.constant_methods["get_vocab_size"])
    rng = random.Random(0)
    prompt = torch.tensor([[rng.randrange(vocab) for _ in range(args.prompt)]])
    prefill: dict[str, list[float]] = {name: [] for name in methods}
    decode: dict[str, list[float]] = {name: [] for name in methods}
    tokens: dict[str, list[int]] = {}
    names = list(methods)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            method = methods[name]
            began = time.perf_counter()
            out = method.execute([prompt, torch.tensor([0])])[0]
            prefill[name].append(time.perf_counter() - began)
            made = [int(out.reshape(-1, vocab)[-1].argmax())]
            for position in range(args.prompt, args.prompt + args.decode):
                began = time.perf_counter()
                out = method.execute([torch.tensor([[made[-1]]]), torch.tensor([position])])[0]
                decode[name].append(time.perf_counter() - began)
                made.append(int(out.reshape(-1, vocab)[-1].argmax()))
            tokens[name] = made
    base = names[0]
    print(f"{case.description}; prompt {args.prompt} tokens in one call, {args.decode} decode steps, 1 thread")
    for name in names:
        p, d = statistics.median(prefill[name]), statistics.median(decode[name])
        pb, db = statistics.median(prefill[base]), statistics.median(decode[base])
        same = "same tokens" if tokens[name] == tokens[base] else "OTHER TOKENS"
        print(
            f"{name:62s} prefill {p * 1e3:8.2f} ms ({p / pb:5.2f}x)  decode {d * 1e3:7.3f} ms/token "
            f"({d / db:5.2f}x)  {same}"
        )


if __name__ == "__main__":
    main()
