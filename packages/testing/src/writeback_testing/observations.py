"""What the oracle compares (see :mod:`writeback_testing.oracle`): an :class:`Observation`
of one call (user outputs, state by name, or the error it raised), eager PyTorch's record of a
program call by call (:func:`eager_run`; :func:`eager_reference` raises :class:`InvalidProgram`
when eager itself fails in a way no target can be held to), the helpers every target records
with (:func:`snapshot`, :func:`error_text`), and :func:`compare_observations`, which finds the
first difference between eager's observation and a target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from writeback.session import ATOL, RTOL

from writeback_testing.program_spec import Built

__all__ = [
    "DEFAULT_CALLS",
    "InvalidProgram",
    "Observation",
    "compare_observations",
    "eager_reference",
    "eager_run",
    "error_text",
    "snapshot",
]

DEFAULT_CALLS = 3


@dataclass(frozen=True)
class Observation:
    """What one call produced: user outputs in order, and state by name (what the target sees).

    ``error`` set: the call raised (``"IndexError: ..."``); ``outputs`` is then empty and
    ``state`` the state after the failed call, for eager the state *before* it (what
    every target must leave: a refused call changes nothing). A call that raised is
    the last one run.
    """

    outputs: tuple[torch.Tensor, ...]
    state: dict[str, torch.Tensor]
    error: str | None = None


def _index_refusal(error: BaseException) -> bool:
    """Whether eager refused a call for an index out of range (not for anything else, such
    as an in-place write onto memory it reads, which leaves nothing to compare)."""
    text = str(error)
    return isinstance(error, IndexError) or "out of bounds" in text or "out of range" in text


def error_text(error: BaseException) -> str:
    """How an observation records an error: its type and the first line of its message."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class InvalidProgram(ValueError):
    """The program fails in eager PyTorch itself: there is nothing to compare against."""


def snapshot(value: Any) -> torch.Tensor:
    """A copy of ``value`` as a tensor, detached, that later writes to ``value`` leave as it is."""
    if not isinstance(value, torch.Tensor):
        return torch.tensor(value)
    return value.detach().clone()


def eager_run(built: Built, calls: int = DEFAULT_CALLS) -> list[Observation]:
    """Run the program eagerly ``calls`` times; every output and state is cloned at once.

    :raises OverlappingWrite: an in-place write reads elements it writes, so eager's
        answer depends on iteration order (``writeback_testing.overlap``).
    """
    from writeback_testing.overlap import NoOverlappingWrites, OverlappingWrite

    module = built.new_module()
    state = built.make_state()
    observations: list[Observation] = []

    def seen() -> dict[str, torch.Tensor]:
        found = {s.name: snapshot(module.get_buffer(s.name)) for s in built.spec.buffers}
        found.update({s.name: snapshot(t) for s, t in zip(built.spec.inputs, state, strict=True)})
        return found

    with torch.no_grad(), NoOverlappingWrites():
        for call in range(calls):
            before = seen()
            try:
                outputs = module(*built.step_inputs(call), *state)
            except OverlappingWrite:
                raise
            except (IndexError, RuntimeError) as error:
                if not _index_refusal(error):
                    raise
                # Eager refuses this call (an index out of range): every target must refuse it
                # too and leave the state as it was before the call.
                observations.append(Observation((), before, error_text(error)))
                break
            if isinstance(outputs, torch.Tensor):
                outputs = (outputs,)
            observations.append(Observation(tuple(snapshot(o) for o in outputs), seen()))
    return observations


def eager_reference(built: Built, calls: int = DEFAULT_CALLS) -> list[Observation]:
    """:func:`eager_run`, or :class:`InvalidProgram` when eager PyTorch itself fails on the
    program in a way no target can be held to (an overlapping in-place write it refuses,
    or one :func:`eager_run` refuses). A call eager refuses for an index out of range
    (``IndexError``, or an "out of bounds" ``RuntimeError``) is an observation with ``error``
    (:class:`Observation`): targets must refuse it too, changing nothing."""
    try:
        observations = eager_run(built, calls)
    except Exception as error:
        raise InvalidProgram(
            f"eager PyTorch fails: {type(error).__name__}: {error}\n--- program ---\n{built.source}"
        ) from error
    return observations


def _differs(expected: torch.Tensor, got: Any) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}: {got!r}"
    if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
        return f"expected {expected.dtype} {tuple(expected.shape)}, got {got.dtype} {tuple(got.shape)}"
    try:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, equal_nan=True)
    except AssertionError as error:
        return f"expected\n{expected}\ngot\n{got}\n({str(error).splitlines()[0]})"
    return None


def compare_observations(expected: Observation, got: Observation) -> tuple[str, str] | None:
    """The first difference as ``(what, detail)``, or ``None``.

    A call eager refused must be refused (any error) with every state the target sees as
    it was before the call; a call eager answered must not raise.
    """
    if expected.error is not None and got.error is None:
        return "refusal", f"eager raised {expected.error}; the target answered instead (a silent answer)"
    if got.error is not None and expected.error is None:
        return "error", f"the target raised {got.error} where eager answers"
    if len(got.outputs) != len(expected.outputs):
        return "output count", f"expected {len(expected.outputs)}, got {len(got.outputs)}"
    for i, (e, g) in enumerate(zip(expected.outputs, got.outputs, strict=True)):
        diff = _differs(e, g)
        if diff:
            return f"output {i}", diff
    for name, value in got.state.items():
        base = name.split(" ")[0]
        if base not in expected.state:
            return f"state {name}", f"the runtime has state {name!r} that eager does not"
        diff = _differs(expected.state[base], value)
        if diff:
            where = f"state {name}" if expected.error is None else f"state {name} after the refused call"
            return where, diff if expected.error is None else f"a refused call changed it ({got.error})\n{diff}"
    return None
