"""Load corrupted copies of a ``.pte`` in this process and count what happened.

Run as ``python -m pybind_runtime.corrupt_worker PTE SEED COUNT``; prints one JSON
line ``{"truncated": {...}, "flipped": {...}}`` of outcome counts. A crash kills
the process, which the calling test sees as a non-zero exit code. Kept out of
the test process so a crash is reported as such instead of killing pytest.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter

import torch
from writeback_core.registry import load_registry
from writeback_pybind_runtime import DelegateError, ProgramError, Runtime

EXPECTED_ERRORS = (ProgramError, ValueError, TypeError, RuntimeError, DelegateError)


def _attempt(runtime: Runtime, data: bytes, inputs: list[torch.Tensor]) -> str:
    try:
        method = runtime.load_program(data).load_method("forward")
        method(inputs)
    except EXPECTED_ERRORS as error:
        return type(error).__name__
    return "ran"


def main(argv: list[str]) -> int:
    path, seed, count = argv[0], int(argv[1]), int(argv[2])
    data = open(path, "rb").read()
    rng = random.Random(seed)
    runtime = Runtime(load_registry(entry_points=False))
    inputs = [torch.ones(4, 4), torch.ones(4, 4)]
    truncated: Counter[str] = Counter()
    flipped: Counter[str] = Counter()
    for k in range(count):
        if k % 2 == 0:
            cut = rng.randrange(0, len(data))
            truncated[_attempt(runtime, data[:cut], inputs)] += 1
        else:
            corrupt = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                corrupt[rng.randrange(len(corrupt))] ^= 1 << rng.randrange(8)
            flipped[_attempt(runtime, bytes(corrupt), inputs)] += 1
    print(json.dumps({"truncated": dict(truncated), "flipped": dict(flipped)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
