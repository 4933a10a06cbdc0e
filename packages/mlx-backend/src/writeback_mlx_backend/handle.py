"""What ``MLXDelegate.init`` makes of a blob, and what each call reads: the :class:`Handle`,
and the compiled path's record of its traced step (:class:`Compiled`, made by
``writeback_mlx_backend.compile_at_init``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from writeback_core.blob import Ref

from writeback_mlx_backend._steps import Step
from writeback_mlx_backend.delegate_program import DelegateProgram, InPlaceCandidate
from writeback_mlx_backend.op_handler import OpHandler
from writeback_mlx_backend.window import Window


@dataclass
class Handle:
    """A loaded program (one per delegate in a ``.pte``): its steps, constants and
    delegate-owned state, and how its calls run."""

    program: DelegateProgram
    steps: list[Step]
    constants: dict[str, Any]
    state: dict[str, Any]
    outputs: list[Any]
    last_use: dict[str, int]
    dies_at: list[list[str]]
    candidates: list[InPlaceCandidate]
    # Candidates the program requires in place (its write-back was dropped).
    forced: list[InPlaceCandidate]
    # For each candidate's node: the values defined before it and read after it
    # that may read or share the destination's memory (they depend on the
    # destination input or on a write into it). Only these can see the write.
    watch: dict[str, list[str]]
    # Which value each delegate-owned buffer becomes after a call (aliases folded).
    state_updates: dict[str, str]
    # ``(output, input)``: outputs the program requires written whole into an input's
    # memory (a state replaced by a new value, its write-back dropped), after every
    # output is evaluated, as the write-back would have.
    whole: list[tuple[int, int]] = field(default_factory=list)
    # The traced step (see ``writeback_mlx_backend.compile_at_init``), or None with ``path`` saying why not.
    compiled: Compiled | None = None
    path: str = "interpreted"
    # The candidates the caller may take in place or not (not forced), checked per call.
    optional: list[InPlaceCandidate] = field(init=False)
    # Per delegate-owned state: whether every value ever stored in it is finite (checked
    # over the whole value at ``init``, then over what each call writes; see ``Written``).
    finite: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        forced = {c.node for c in self.forced}
        self.optional = [c for c in self.candidates if c.node not in forced]


@dataclass(frozen=True)
class ShapeOnly:
    """What an index check reads of the indexed tensor: its shape (for a traced step)."""

    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class Compiled:
    """A program traced once: ``fn(inputs, state) -> [*outputs, *new state]``."""

    fn: Callable[[list[Any], list[Any]], list[Any]]
    state_keys: list[str]
    update_keys: list[str]
    # Each indexing step's check, recorded while tracing: ``validate`` and its
    # arguments, the indices as references to inputs or constants, the rest as
    # shapes or literals. It names the bad index when a bound below fails.
    checks: list[tuple[OpHandler, list[Any], dict[str, Any]]] = field(default_factory=list)
    # ``(position, lo, hi, check)``: the values of that input (or, past the inputs, of that
    # pinned index) must lie in ``[lo, hi)``; read on the host before the graph is built.
    bounds: list[tuple[int, int, int, int]] = field(default_factory=list)
    # The attention window (see ``writeback_mlx_backend.window``), and the step traced
    # per bounded length, made on the first call that needs it.
    window: Window | None = None
    bounded: dict[int, Callable[[list[Any], list[Any]], list[Any]] | None] = field(default_factory=dict)
    # Indices computed inside the program (from inputs, constants and the state at the
    # call's start): ``pinned_fn`` computes them alone, evaluated before the graph is
    # built so they are checked on the host; the traced step reads them as extra inputs.
    pinned: list[str] = field(default_factory=list)
    pinned_fn: Callable[[list[Any], list[Any]], list[Any]] | None = None
    # The writes the program requires in callers' tensors (see ``CallerWrite``), in
    # program order. With any, only bounded steps run compiled; ``fn`` is never called.
    caller_writes: list[CallerWrite] = field(default_factory=list)
    # The values a bounded trace cuts whole, with the axis (``window_trace.Bounded.sources``), and
    # per delegate-owned state they read, how a call's write into it is checked (``Written``).
    sources: set[tuple[str, int]] = field(default_factory=set)
    watched: dict[str, Written | None] = field(default_factory=dict)


@dataclass(frozen=True)
class CallerWrite:
    """A write the program requires in a caller's tensor, on the compiled path.

    The bounded step never computes the written tensor whole (``window_trace.Unread``): it
    reads the write over the first ``L`` columns only, and returns the written values
    (``sources``). After the one evaluation the call stores that region into the
    caller's memory on the host, as the interpreted path does at the write.
    """

    step: Step
    input: int
    output: int
    shape: tuple[int, ...]
    # The step's arguments other than the destination and the indices: the written values.
    sources: list[str]


@dataclass(frozen=True)
class Written:
    """The rows a call's write into a delegate-owned state stores: ``index`` along ``axis``
    (a reference to an input, a computed index or a constant, read on the host)."""

    axis: int
    index: Ref
