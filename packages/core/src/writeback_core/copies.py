"""The whole-state copies a lowered program still makes, and why: what writeback says out loud.

A mutated state is written in place only when core recorded an accepted in-place decision
for it (a writeback-wrapped partitioner asked the plugins) and a pass then made the write in
place. Every other mutation keeps exir's write-back ``copy_``, which moves the whole state on
every call. :func:`copies_left` names each such copy with its cost, its cause and what to do;
:func:`warn_copies_left` says it once per program as a :class:`CopyLeftWarning`, which the
standard :mod:`warnings` filters silence.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType

from torch.export import ExportedProgram

from writeback_core.meta import COPY_LEFT_REASON, get_custom
from writeback_core.registry import InPlaceDecision

__all__ = [
    "CopyLeft",
    "CopyLeftWarning",
    "caller_stacklevel",
    "copies_left",
    "describe_copies",
    "idiom",
    "warn_copies_left",
]


class CopyLeftWarning(UserWarning):
    """A lowered program still copies a mutated state back whole on every call.

    Silence it as any warning: ``warnings.filterwarnings("ignore", category=CopyLeftWarning)``.
    """


@dataclass(frozen=True)
class CopyLeft:
    """One whole-state write-back copy left in a program.

    ``state`` is the buffer's name (or the caller's input); ``kind`` ``"buffer"`` or
    ``"input"``; ``nbytes`` what the copy moves per call; ``reason`` why no in-place write
    replaced it; ``fix`` what to do about it (empty when nothing in the script would change it).
    """

    state: str
    kind: str
    nbytes: int
    reason: str
    fix: str


def idiom(backend: str) -> str:
    """The two lines that lower a user's program with writeback's decisions for ``backend``."""
    return (
        f"to_edge_transform_and_lower(ep, **writeback_core.to_edge_arguments({backend!r})) "
        "and writeback_passes.to_executorch(edge)"
    )


def _why(decision: InPlaceDecision | None, backend: str) -> tuple[str, str]:
    if decision is None:
        return (
            "no in-place decision was recorded for it: no writeback-wrapped partitioner saw it",
            f"lower with {idiom(backend)}",
        )
    if decision.declined_by:
        plugins = ", ".join(repr(p) for p in decision.declined_by)
        return f"plugin {plugins} declined to write it in place for backend {decision.backend!r}", ""
    if not decision.accepted:
        return f"no installed plugin accepts writing it in place for backend {decision.backend!r}", ""
    return (
        f"accepted by {', '.join(repr(p) for p in decision.accepted_by)}, but no pass made the write in place",
        "lower with writeback_passes.to_executorch(edge): exir's own to_executorch runs none of writeback's passes",
    )


def copies_left(
    decisions: Mapping[str, InPlaceDecision], program: ExportedProgram, backend: str | None = None
) -> list[CopyLeft]:
    """The write-back copies of ``program`` (a final, ``to_executorch``-ed method), each with its cause.

    ``decisions`` are core's, keyed by target (buffer name, or the input's name for a
    caller's state), as recorded before ``to_executorch``; ``backend`` names the backend in
    the advice when no decision does.
    """
    from writeback_core.program_passes import write_back_bytes

    signature = program.graph_signature
    buffers = dict(signature.inputs_to_buffers)
    backends = {d.backend for d in decisions.values()}
    backend = next(iter(backends)) if len(backends) == 1 else backend or "<backend>"
    from writeback_core.ops import write_back_copies

    kept = {str(c.args[0]): get_custom(c, COPY_LEFT_REASON) for c in write_back_copies(program.graph_module.graph)}
    found = []
    for placeholder, nbytes in write_back_bytes(program).items():
        target = buffers.get(placeholder, placeholder)
        said = kept.get(placeholder)
        # A pass that kept the copy said why, in the model's terms; its passes ran.
        reason, fix = (said, "") if isinstance(said, str) else _why(decisions.get(target), backend)
        found.append(CopyLeft(target, "buffer" if placeholder in buffers else "input", nbytes, reason, fix))
    return found


def describe_copies(copies: list[CopyLeft], method: str = "forward") -> str:
    """The message of :func:`warn_copies_left`: one line per copy, then each distinct fix."""
    total = sum(c.nbytes for c in copies)
    noun = "state is" if len(copies) == 1 else "states are"
    lines = [f"{len(copies)} mutated {noun} copied back whole on every call of {method!r} ({total} bytes per call):"]
    lines += [f"  {c.kind} {c.state!r} ({c.nbytes} bytes): {c.reason}" for c in copies]
    fixes = list(dict.fromkeys(c.fix for c in copies if c.fix))
    lines += [f"to write them in place: {fix}" for fix in fixes]
    return "\n".join(lines)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside torch, exir and
    writeback: the line of the user's script that lowered the program."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if not any(part in name for part in _LIBRARY_PARTS):
            return level
        frame, level = frame.f_back, level + 1
    return 1


_LIBRARY_PARTS = ("/torch/", "/executorch/", "/writeback_", "/contextlib.py", "/copyreg.py", "/functools.py")


def warn_copies_left(copies: list[CopyLeft], method: str = "forward") -> None:
    """Warn once about every copy in ``copies`` (nothing when it is empty), at the caller's line."""
    if copies:
        warnings.warn(describe_copies(copies, method), CopyLeftWarning, stacklevel=caller_stacklevel())
