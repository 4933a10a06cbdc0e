"""Whether a step's gap from eager fp32 is fp32's own rounding or a fault: judged against float64.

A program that computes eager's math in fp32 in another order (XNNPACK's kernels, ExecuTorch's
portable ones) differs from eager fp32 by rounding, and over many layers the rounding grows past
any fixed tolerance: Mamba-130M's 24 layers put eager fp32 itself 1.7e-3 away from the same model
in float64, on logits up to 13.8. The gap between the two fp32 answers cannot say which one is off,
so both are measured against the same model run in float64, as ONNX Runtime and torch users
judge a converted model against a higher-precision reference.

:class:`Float64Reference` does it for ``writeback run``:

1. Only a step the fixed tolerance refuses is judged (:meth:`Float64Reference.judge`); a run whose
   steps all match builds nothing.
2. The first judged step builds the model again (``run`` frees eager's weights with the
   delegated ones before the program loads) and refuses that build unless its weights equal those
   exported (checksums taken when the program was partitioned): a new build is the module as it
   is before its first step, buffers, call counters and a cache object's tensors included. It is
   then copied in float64: every floating parameter and buffer is converted one tensor at a time
   straight into the copy (tied weights stay tied), so it starts where the run started, with the
   very weights exported. It then runs every step from 0 to
   the judged one with the same inputs (floating ones in float64); a later judged step continues
   from where it stopped.
3. For each output and caller-owned state: ``program_error = max|program - float64|`` and
   ``fp32_error = max|eager fp32 - float64|``. The step matches when, for every tensor,
   ``program_error <= FP32_FACTOR * fp32_error + atol`` (the case's ``atol``). ``FP32_FACTOR = 8``:
   two fp32 computations of the same math in different orders have rounding errors of the same
   size; measured, the program's largest error is 1.2x eager fp32's on the ill-conditioned test
   model and 2.2x (XNNPACK) and 2.4x (portable) on the Mamba-130M shape, whose float64 copy still
   rounds to fp32 where Hugging Face's code casts (norms, the residual), which makes eager fp32's
   error look smaller. 8 leaves three times that room; a fault (a dropped state write, other
   weights, a wrong index) moves values by their own size: weights off by 1e-2 give 70x.
4. :meth:`Float64Reference.release` frees the copy; ``run`` calls it after its last step.

Refused: a program whose weights differ from eager's by 1e-2 (its error from float64 is 70 to
480 times eager fp32's), a step whose integer output differs (compared exactly), and a model
whose float64 copy cannot run (an op without a float64 kernel: the step stays refused, the reason
given), or whose new build has other weights than those exported (unseeded random
initialisation: the step stays refused, the tensor named). Quantized runs keep their scheme's
fixed tolerance: their integer kernels round activations at 8 bits, a rounding float64 cannot
stand for, and ``run`` builds no reference for them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from writeback_core.types import ModelCase

__all__ = ["FP32_FACTOR", "Float64Check", "Float64Reference"]

FP32_FACTOR = 8.0


@dataclass(frozen=True)
class Float64Check:
    """One step judged against float64 eager: the largest error of the program and of eager fp32
    from float64 (over outputs and caller-owned state), and the tensors beyond the bound (empty
    when the step matches within fp32's own rounding). ``unavailable``: why no float64 reference
    could be run (then the step stays refused)."""

    program_error: float
    fp32_error: float
    problems: tuple[str, ...]
    unavailable: str | None = None

    @property
    def ok(self) -> bool:
        return self.unavailable is None and not self.problems


def _float64(value: Any) -> Any:
    """``value`` with every floating tensor in it converted to float64 (others as they are)."""
    return pytree.tree_map(
        lambda leaf: leaf.to(torch.float64) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf,
        value,
    )


_ADVICE = "seed it (torch.manual_seed) or load its weights, so the float64 reference runs the weights exported"


class _NoCopy(RuntimeError):
    """The module built for the reference cannot be copied in float64."""


def _float64_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose floating parameters and buffers are float64. Each tensor is
    converted once, straight into the copy (``copy.deepcopy``'s memo maps the original to its
    float64 version, so a tied weight stays tied)."""
    memo: dict[int, Any] = {}
    held = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    for _, tensor in held:
        if id(tensor) not in memo and tensor.is_floating_point():
            converted = tensor.detach().to(torch.float64)
            is_parameter = isinstance(tensor, torch.nn.Parameter)
            memo[id(tensor)] = torch.nn.Parameter(converted, requires_grad=False) if is_parameter else converted
    return copy.deepcopy(module, memo)


def _max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.numel() == 0:
        return 0.0
    return float((actual.double() - expected.double()).abs().max())


class Float64Reference:
    """Eager's model in float64, built at the first step the fixed tolerance refuses (see the module).

    ``build`` gives the module as it is before its first step, with the weights exported (it
    raises :class:`~writeback.eager_weights.WeightsDiffer` otherwise): called at the first judged
    step only. :meth:`judge` each refused step in increasing order, :meth:`release` at the end."""

    def __init__(
        self, case: ModelCase, build: Callable[[str, str], torch.nn.Module], factor: float = FP32_FACTOR
    ) -> None:
        self.case = case
        self.factor = factor
        self._make = build
        self._module: torch.nn.Module | None = None
        self._state: tuple[Any, ...] = ()
        self._outputs: list[Any] = []
        self._fed = 0  # steps the float64 copy has run
        self._broken: str | None = None

    def _build(self) -> None:
        module = self._make("its float64 reference", _ADVICE)
        try:
            self._module = _float64_copy(module)
        except Exception as error:  # a module deepcopy cannot copy (it holds a lock, say): no reference
            failed = f"{type(error).__name__}: {error}"
            raise _NoCopy(f"copying the module before its first step failed: {failed}") from error
        self._module.eval()
        self._state = tuple(_float64(self.case.make_state()))

    def _run_to(self, step: int) -> list[Any]:
        """The float64 outputs of ``step``, running the copy on from the last step it ran."""
        if self._module is None:
            self._build()
        assert self._module is not None
        if step < self._fed - 1:
            raise ValueError(f"step {step} was passed: the float64 reference is at step {self._fed - 1}")
        with torch.no_grad():
            while self._fed <= step:
                inputs = _float64(self.case.step_inputs(self._fed))
                kwargs = _float64(self.case.example_kwargs(self._fed))
                self._outputs = pytree.tree_leaves(self._module(*inputs, *self._state, **kwargs))
                self._fed += 1
        return self._outputs

    def judge(
        self,
        step: int,
        outputs: Sequence[Any],
        state: Sequence[torch.Tensor],
        eager_outputs: Sequence[Any],
        eager_state: Sequence[torch.Tensor],
        atol: float,
    ) -> Float64Check:
        """Judge the program's ``outputs`` and ``state`` at ``step`` against float64 eager, with eager
        fp32's ``eager_outputs`` and ``eager_state`` as the measure of fp32's own rounding."""
        if self._broken is None:
            try:
                reference = self._run_to(step)
            except _NoCopy as error:
                self._broken = str(error)
                self.release()
            except Exception as error:  # the new build refused, or what the model raises in float64: say why
                self._broken = f"{type(error).__name__}: {error}"
                self.release()
        if self._broken is not None:
            return Float64Check(float("nan"), float("nan"), (), unavailable=self._broken)
        named = [(f"output {i}", *t) for i, t in enumerate(zip(outputs, eager_outputs, reference, strict=False))]
        named += [(f"state {i}", *t) for i, t in enumerate(zip(state, eager_state, self._state, strict=False))]
        program_worst = fp32_worst = 0.0
        problems: list[str] = []
        for what, mine, eager32, exact in named:
            problem, program_error, fp32_error = self._tensor(what, mine, eager32, exact, atol)
            program_worst, fp32_worst = max(program_worst, program_error), max(fp32_worst, fp32_error)
            if problem is not None:
                problems.append(problem)
        return Float64Check(program_worst, fp32_worst, tuple(problems))

    def _tensor(self, what: str, mine: Any, eager32: Any, exact: Any, atol: float) -> tuple[str | None, float, float]:
        """``(problem or None, program error, fp32 error)`` of one output or state."""
        tensors = all(isinstance(t, torch.Tensor) for t in (mine, eager32, exact))
        if not tensors or mine.shape != exact.shape or eager32.shape != exact.shape:
            same = mine == eager32 if not tensors else False
            return (None if same else f"{what} differs from eager in kind or shape"), 0.0, 0.0
        if not exact.is_floating_point():
            if torch.equal(mine, eager32):
                return None, 0.0, 0.0
            return f"{what} {tuple(mine.shape)} (integer) differs from eager", float("inf"), 0.0
        program_error, fp32_error = _max_error(mine, exact), _max_error(eager32, exact)
        bound = self.factor * fp32_error + atol
        if program_error <= bound:
            return None, program_error, fp32_error
        return (
            f"{what} {tuple(mine.shape)} is {program_error:.3g} from float64 eager, where eager fp32 itself is "
            f"{fp32_error:.3g} from it (bound {self.factor:g} x {fp32_error:.3g} + atol {atol:g} = {bound:.3g})",
            program_error,
            fp32_error,
        )

    def release(self) -> None:
        """Free the float64 copy and its state."""
        self._module, self._state, self._outputs = None, (), []
