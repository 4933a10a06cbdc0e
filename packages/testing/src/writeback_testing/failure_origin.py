"""Where a target's failure was raised: upstream (torch, ExecuTorch, MLX), the harness
(this package, or the target's own module), or writeback's packages.

The oracle skips a program as "upstream" only when the target fails on the program lowered
without writeback's passes too *and* that failure was raised inside an upstream library. A
failure raised by the harness's own code (an ``AttributeError`` in a target, a wrong index
in an observation) is a harness bug: it is raised as :class:`HarnessError`, never counted
as upstream, so a broken harness cannot make the fuzzer skip every program it draws.
"""

from __future__ import annotations

import traceback
from typing import Literal

__all__ = ["UPSTREAM_MODULES", "HarnessError", "failure_origin"]

# Top-level packages whose errors are upstream's (the libraries writeback builds on).
UPSTREAM_MODULES = frozenset({"torch", "torchgen", "executorch", "mlx", "numpy", "transformers", "tensorrt"})

Origin = Literal["upstream", "harness", "writeback"]


class HarnessError(RuntimeError):
    """A target failed inside the harness's own code: a bug of the test harness, not of the
    program, of writeback or of upstream. Fix the code it names."""

    def __init__(self, target: str, error: BaseException, where: str, source: str) -> None:
        self.target = target
        self.error = error
        self.where = where
        super().__init__(
            f"{target}: {type(error).__name__}: {error} (raised by the harness at {where}, not by torch, "
            "ExecuTorch or MLX: a bug of the test harness, not an upstream failure; fix the harness)"
            f"\n--- reproducer ---\n{source}"
        )


def _innermost(error: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(error.__traceback__)
    return frames[-1] if frames else None


def failure_origin(error: BaseException, harness_modules: frozenset[str]) -> tuple[Origin, str]:
    """Where ``error`` was raised, and the ``file:line`` of the innermost frame.

    :param harness_modules: top-level module names and dotted module names counted as the
        harness (``writeback_testing`` and the target's own module).
    """
    tb = error.__traceback__
    module = ""
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        tb = tb.tb_next
    frame = _innermost(error)
    where = f"{frame.filename}:{frame.lineno}" if frame is not None else "an unknown place"
    top = module.split(".", 1)[0]
    if top in UPSTREAM_MODULES:
        return "upstream", where
    if top in harness_modules or module in harness_modules:
        return "harness", where
    return "writeback", where
