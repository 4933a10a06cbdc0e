"""Child process of tests/e2e/test_hostile_calls.py: feeds a decoder `.pte` hostile calls in one
runtime or both and prints one JSON line per case (a case that aborts the process leaves a
``start`` line without its result, which the parent reports as an abort).

``python -m tests.e2e.hostile_call_worker PTE RUNTIME/CASE...`` with RUNTIME ``writeback`` or
``stock``: both runtimes' cases in one process, which imports torch and ExecuTorch once. For
each case, in a fresh method: a good prefill of three tokens at positions 0-2, the hostile call,
then one probe token at position 3. The line holds the hostile call's outcome
(``error`` with its type and message, or ``ok`` with whether its logits hold NaN and whether
they equal a contiguous call's), and whether the probe's logits equal those of the same prefill
and probe with no hostile call between (``unchanged``: nothing the refused call did is left in
the caches).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

CACHE = 16  # the test folder's max_position_embeddings
PROMPT = torch.tensor([[5, 6, 7]])


def _cases() -> dict[str, tuple[Any, Any]]:
    i64 = torch.int64
    three = torch.tensor([[1, 2, 3]])
    return {
        "three_tokens_one_position": (three, torch.tensor([3])),
        "three_tokens_four_positions": (three, torch.arange(3, 7)),
        "tokens_of_batch_2": (torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.arange(3, 6)),
        "negative_positions": (three, torch.arange(-5, -2)),
        "huge_positions": (three, torch.arange(3) + (1 << 40)),
        "positions_past_the_cache": (three, torch.arange(CACHE - 2, CACHE + 1)),
        "zero_tokens": (torch.zeros(1, 0, dtype=i64), torch.zeros(0, dtype=i64)),
        "zero_tokens_one_position": (torch.zeros(1, 0, dtype=i64), torch.tensor([3])),
        "more_tokens_than_the_cache": (torch.ones(1, CACHE + 1, dtype=i64), torch.arange(CACHE + 1)),
        "token_id_past_the_vocabulary": (torch.tensor([[1, 2, 1000]]), torch.arange(3, 6)),
        "int32_tokens": (three.to(torch.int32), torch.arange(3, 6)),
        "float_tokens": (three.to(torch.float32), torch.arange(3, 6)),
        "int32_positions": (three, torch.arange(3, 6, dtype=torch.int32)),
        "tokens_of_rank_1": (torch.tensor([1, 2, 3]), torch.arange(3, 6)),
        "positions_of_rank_2": (three, torch.arange(3, 6).reshape(1, 3)),
        "non_contiguous_tokens": (torch.tensor([[1, 9, 2, 9, 3, 9]])[:, ::2], torch.arange(3, 6)),
    }


def _method(runtime: str, pte: str) -> Callable[[list[Any]], list[Any]]:
    from writeback_core.llm_runner import load_runner_kernels

    load_runner_kernels()
    if runtime == "stock":
        from executorch.runtime import Runtime as StockRuntime

        program = StockRuntime.get().load_program(pte)
        method = program.load_method("forward")
        _method.keep = program  # type: ignore[attr-defined]  # a Method outliving its Program reads freed memory
        return lambda inputs: list(method.execute(inputs))
    from writeback_pybind_runtime import Runtime

    wb_method = Runtime.get().load_program(pte).load_method("forward")
    return lambda inputs: wb_method(inputs)


def _probe(call: Callable[[list[Any]], list[Any]]) -> torch.Tensor:
    out: torch.Tensor = call([torch.tensor([[4]]), torch.tensor([3])])[0]
    return out.clone()


def main() -> None:
    pte, *pairs = sys.argv[1:]
    cases = _cases()
    expected_probes: dict[str, torch.Tensor] = {}
    for pair in pairs:
        runtime, name = pair.split("/")
        if runtime not in expected_probes:
            clean = _method(runtime, pte)
            clean([PROMPT, torch.arange(3)])
            expected_probes[runtime] = _probe(clean)
        print(json.dumps({"start": pair}), flush=True)
        tokens, positions = cases[name]
        call = _method(runtime, pte)
        call([PROMPT, torch.arange(3)])
        result: dict[str, Any] = {"case": pair}
        try:
            logits = call([tokens, positions])[0]
        except Exception as error:  # the outcome is reported, whatever the type
            result.update(outcome="error", type=type(error).__name__, message=str(error))
        else:
            result.update(outcome="ok", nan=bool(torch.isnan(logits).any()))
            fresh = _method(runtime, pte)
            fresh([PROMPT, torch.arange(3)])
            contiguous = fresh([tokens.contiguous(), positions.contiguous()])[0]
            result["equals_contiguous_call"] = bool(torch.equal(logits, contiguous))
        result["unchanged"] = bool(torch.equal(_probe(call), expected_probes[runtime]))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
