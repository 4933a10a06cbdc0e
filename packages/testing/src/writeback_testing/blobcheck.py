"""The blob fuzzer's oracle (step 3 of :mod:`writeback_testing.blobfuzz`): a :class:`Runner`
runs one mutant through the real path (a delegate's ``init``, ``execute``, ``destroy``; the
runtime's ``load_program``, ``load_method`` and a call), and its :class:`Outcome` is a clean
refusal, a run, eager's answer, or a finding (:data:`FINDINGS`): a wrong answer, or an
internal error escaping, as :func:`classify_error` tells it from a clean one.
"""

from __future__ import annotations

import linecache
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from writeback_testing.blobmutants import make_mutant
from writeback_testing.blobseeds import Seed, build_seeds

__all__ = ["FINDINGS", "Outcome", "Runner", "classify_error", "run_mutant"]

# Messages Python itself gives for a failed index, lookup, parse or unpack: an
# internal error of the code that read the blob, never a clean refusal.
_PYTHON_MESSAGES = (
    "list index out of range",
    "tuple index out of range",
    "string index out of range",
    "invalid literal for int()",
    "Exceeds the limit",
    "values to unpack",
    "unhashable type",
    "object is not subscriptable",
    "object is not iterable",
    "object is not callable",
    "unsupported operand type",
    "positional argument",
    "'NoneType'",
    "has no attribute",
    "can't multiply sequence",
    "is not in list",
    "must be str, not",
    "must be real number",
    "not supported between instances",
    "can only concatenate",
    "object cannot be interpreted as an integer",
    "Overflow when unpacking",
    "argument must be",
    "too large to convert",
)
_CLEAN_TYPES = (ValueError, IndexError, TypeError, RuntimeError, NotImplementedError)
FINDINGS = ("wrong", "escaped", "crash", "hang")


@dataclass
class Outcome:
    """What one mutant did: ``kind`` (``refused``, ``ran``, ``equal``, or a finding:
    ``wrong``, ``escaped``, ``crash``, ``hang``) and a one-line ``detail``."""

    kind: str
    detail: str = ""


def classify_error(error: BaseException) -> Outcome:
    """``refused`` for a clean error, ``escaped`` for an internal one (see the module doc)."""
    from writeback_core.blob import BlobError

    message = str(error)
    described = f"{type(error).__name__}: {message[:300]}"
    if isinstance(error, BlobError):
        return Outcome("refused", described)
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    cause = error.__cause__
    if cause is not None and not isinstance(error, BlobError):
        inner = classify_error(cause)
        if inner.kind == "escaped":
            return Outcome("escaped", f"{described} <- {inner.detail}")
    if not isinstance(error, _CLEAN_TYPES) or not message.strip():
        return Outcome("escaped", described + where)
    if any(text in message for text in _PYTHON_MESSAGES):
        return Outcome("escaped", described + where)
    if frames:
        line = (frames[-1].line or linecache.getline(frames[-1].filename, frames[-1].lineno or 0)).strip()
        if line.startswith("raise"):
            return Outcome("refused", described)
        if "mx." in line or "mlx" in frames[-1].filename:
            return Outcome("escaped", f"{described}{where}: an MLX error surfacing as is")
    return Outcome("refused", described)


def _close(got: Any, expected: Any) -> bool:
    import torch

    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    return bool(torch.allclose(got.double(), expected.double(), atol=1e-4, rtol=1e-4, equal_nan=True))


def _answer_differs(seed: Seed, args: Sequence[Any], outputs: Sequence[Any] | None) -> str | None:
    """Why the call's answer is not eager's: each output in its slot, or (a delegate writing
    state in place) in one of its inputs."""
    got = list(outputs) if outputs is not None else list(args[seed.num_inputs :])
    for k, expected in enumerate(seed.expected):
        if k < len(got) and _close(got[k], expected):
            continue
        if outputs is None and any(_close(a, expected) for a in args[: seed.num_inputs]):
            continue
        shown = got[k].flatten()[:6].tolist() if k < len(got) and hasattr(got[k], "flatten") else "nothing"
        return f"output {k}: expected {expected.flatten()[:6].tolist()}, got {shown}"[:300]
    return None


class Runner:
    """Runs mutants of one target through the real path, reusing delegates and runtime."""

    def __init__(self, registry: Any, target: str, seeds: list[Seed] | None = None) -> None:
        self.target = target
        self.registry = registry
        self.seeds = build_seeds(registry, target) if seeds is None else seeds
        if not self.seeds:
            raise ValueError(f"target {target!r}: no seed program lowers to it")
        self.delegates = registry.runtime_delegates()
        self.fields: list[Any] = []
        if target == "pte":
            from writeback_testing.ptefields import plan_fields
            from writeback_testing.targets import registry_runtime

            runtime = registry_runtime(registry)
            if runtime is None:
                raise ValueError("target 'pte': the registry offers no runtime (writeback_runtimes)")
            self.runtime = runtime
            self.fields = [plan_fields(s.blob) for s in self.seeds]

    def run(self, seed: Seed, blob: bytes, unchanged: bool) -> Outcome:
        import torch

        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in seed.args]
        outputs: list[Any] | None = None
        try:
            if self.target == "pte":
                method = self.runtime.spec.load_program(blob, self.delegates).load_method("forward")
                outputs = list(method.execute(args))
                outputs = outputs[len(outputs) - len(seed.expected) :]
            else:
                delegate = self.delegates[seed.backend_id]
                handle = delegate.init(blob, seed.specs)
                try:
                    delegate.execute(handle, args)
                finally:
                    delegate.destroy(handle)
        except Exception as error:
            outcome = classify_error(error)
            if unchanged:
                return Outcome("wrong", f"an unchanged program was refused: {outcome.detail}")
            return outcome
        if not unchanged:
            return Outcome("ran")
        differs = _answer_differs(seed, args, outputs)
        return Outcome("wrong", differs) if differs else Outcome("equal")


def run_mutant(runner: Runner, seed: int, index: int) -> tuple[str, Outcome]:
    """Make mutant ``index`` of the runner's target and run it: ``(its path, outcome)``."""
    chosen, path, blob, unchanged = make_mutant(runner.seeds, seed, runner.target, index, runner.fields)
    return path, runner.run(chosen, blob, unchanged)
