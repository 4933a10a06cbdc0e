"""The MLX runtime delegate: interprets a :class:`DelegateProgram` with MLX on each call.

``execute`` gets the delegate's arguments as torch tensors over the runtime's
memory (inputs, then outputs). What it guarantees:

1. Inputs allocated by :func:`writeback_mlx_backend.empty` are read in place
   (their MLX array is used directly); any other tensor is copied into MLX.
2. Delegate-owned buffers live as MLX arrays in the handle. Their writes are
   MLX updates whose input has no other reference when evaluated, so MLX
   reuses (donates) the buffer: a one-slot write costs O(update).
3. A write into a user input is done in place only when the runtime passed the
   same memory as that input and as the write's output (the write-back was
   dropped for it, see ``writeback_passes.reinplace_delegate_input_mutations``).
   Then, at the write: every value still needed later is evaluated first (so
   reads before the write see old values), any such value whose memory overlaps
   the destination is snapshotted, indices are validated, and only the written
   region is stored into the destination. Otherwise the write is functional.
4. Every output is evaluated before any output is written into runtime memory,
   and an output whose memory overlaps another output's destination is
   snapshotted first; an output already in its destination memory is not
   copied.
5. A bad index raises (``IndexError``) before anything is written.

How a call runs. At ``init`` every step whose arguments are all constants (the
transposes of weights that ``linear`` decomposes into, masks built from
``arange``) is computed once and kept contiguous, so matmuls read weights laid out
for them. Then the step is traced once with ``mx.compile`` when the program allows
it (``writeback_mlx_backend.compile_at_init``), and a call runs the traced step
(``writeback_mlx_backend.compiled_call``); otherwise, and for a call the traced step
cannot take, the program is interpreted (``writeback_mlx_backend.interpreted``),
which evaluates at each in-place write. :meth:`MLXDelegate.path` says which path a
handle got and why. What a handle holds is in ``writeback_mlx_backend.handle``; what
a call does whichever path runs it, in ``writeback_mlx_backend.calls``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.blob import BlobError, Kind, Ref, check_call, in_place_outputs
from writeback_core.meta import IN_PLACE_OUTPUTS_SPEC

from writeback_mlx_backend._names import BACKEND_ID
from writeback_mlx_backend._steps import Step, call_resolved, refs
from writeback_mlx_backend.calls import COPY_HISTORY, same_memory
from writeback_mlx_backend.compile_at_init import compile_step
from writeback_mlx_backend.compiled_call import CompiledPath
from writeback_mlx_backend.delegate_program import (
    DELEGATE,
    DelegateProgram,
    InPlaceCandidate,
    TensorRecord,
    float_value,
)
from writeback_mlx_backend.fast.rms_norm import fuse_rms_norms
from writeback_mlx_backend.fast.rope import fuse_ropes
from writeback_mlx_backend.fast.sdpa import fuse_attention
from writeback_mlx_backend.handle import Handle
from writeback_mlx_backend.interpreted import InterpretedPath, memory_plan
from writeback_mlx_backend.literals import check_literals
from writeback_mlx_backend.op_handler import mlx_dtype
from writeback_mlx_backend.op_table import OPS

__all__ = ["COPY_HISTORY", "IN_PLACE_OUTPUTS_SPEC", "FusionsSkippedWarning", "MLXDelegate"]


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "$v" in value:
            return Ref(str(value["$v"]))
        if "$dtype" in value:
            return mlx_dtype(str(value["$dtype"]))
        if "$float" in value:
            return float_value(value["$float"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def _kind(value: Any) -> Kind:
    if isinstance(value, Ref):
        return "ref"
    return "dtype" if isinstance(value, mx.Dtype) else None


def _load(program: DelegateProgram, record: TensorRecord) -> Any:
    """A record as an MLX array of its own: zeros allocated here, or a copy of its bytes."""
    if record.zeros:
        return mx.zeros(record.shape, dtype=mlx_dtype(record.dtype))
    return mx.array(program.array(record))


def _forced(
    program: DelegateProgram,
    compile_specs: Mapping[str, bytes],
    outputs: Sequence[Any],
    info: Mapping[str, tuple[tuple[int, ...], Any]],
) -> tuple[list[InPlaceCandidate], list[tuple[int, int]]]:
    """The in-place outputs the compile specs require: writes into an input's region (in
    ``program.in_place``), and outputs written whole into an input (``(output, input)``),
    whose traced shape and dtype (``info``, by the name ``outputs`` gives) must be the input's."""
    unknown = sorted(set(compile_specs) - {IN_PLACE_OUTPUTS_SPEC})
    if unknown:
        # A newer pipeline may ask for behaviour this runtime does not have; running
        # anyway could return wrong results, so refuse by name.
        raise BlobError(
            DELEGATE,
            "compile_specs",
            unknown,
            f"this runtime knows only {[IN_PLACE_OUTPUTS_SPEC]}; upgrade writeback-mlx-backend",
        )
    forced, whole = [], []
    for output, input_ in in_place_outputs(compile_specs, DELEGATE, len(program.inputs), len(program.outputs)):
        match = [c for c in program.in_place if c.output == output and c.input == input_]
        if match:
            forced.append(match[0])
            continue
        value, meta = outputs[output], program.input_meta[input_]
        # A program whose steps did not trace at init (scalar inputs) has no shape here;
        # each call then checks the value before writing anything (``check_whole``).
        traced = info.get(value.name) if isinstance(value, Ref) else None
        want = (tuple(meta.get("shape", ())), mlx_dtype(meta["dtype"])) if "dtype" in meta else None
        if not isinstance(value, Ref) or want is None or (traced is not None and traced != want):
            raise ValueError(
                f"the program asks the MLX delegate to write output {output} into input {input_} in place, "
                f"but that output ({traced}) is neither a write into that input (writes it can do in place: "
                f"{program.in_place}) nor a new value of its shape and dtype ({want}); was the write-back "
                "dropped for a mutation this backend did not accept?"
            )
        whole.append((output, input_))
    return forced, whole


def _rename(value: Any, renames: Mapping[str, str]) -> Any:
    if isinstance(value, Ref):
        return Ref(renames.get(value.name, value.name))
    if isinstance(value, list):
        return [_rename(v, renames) for v in value]
    if isinstance(value, dict):
        return {k: _rename(v, renames) for k, v in value.items()}
    return value


def _fold_aliases(steps: Sequence[Step]) -> tuple[list[Step], dict[str, str]]:
    """Drop the steps whose op returns its argument itself; later uses name that argument.

    Every write keeps its own step. Returns the steps left and ``{alias: value}``.
    """
    renames: dict[str, str] = {}
    kept = []
    for step in steps:
        args, kwargs = _rename(step.args, renames), _rename(step.kwargs, renames)
        if step.handler.alias and args and isinstance(args[0], Ref):
            renames[step.name] = args[0].name
            continue
        kept.append(Step(step.name, step.op, step.handler, args, kwargs, step.dtype))
    return kept, renames


# A folded constant may be at most this many bytes larger than the constants it
# is computed from (a mask built from ``arange`` is allowed; an ``expand`` of a
# weight into a much larger array is left to run per call).
_FOLD_GROWTH = 1 << 20


def _fold_constants(steps: Sequence[Step], constants: dict[str, Any], kept: Sequence[str]) -> list[Step]:
    """Compute once every step whose arguments are all constants; return the steps left.

    Each folded value joins ``constants`` contiguous (``permute_copy`` of a weight
    becomes the transposed weight laid out for the matmul that reads it); a constant
    nothing reads any more is dropped. Writes are never folded, nor a step that
    raises here (it raises on each call instead) or whose value would be much larger
    than its inputs.
    """
    left = []
    for step in steps:
        names = refs((step.args, step.kwargs))
        if step.handler.region is not None or not all(name in constants for name in names):
            left.append(step)
            continue
        try:
            value = call_resolved(step, constants, traced=False)
        except Exception:
            left.append(step)
            continue
        budget = sum(constants[name].nbytes for name in set(names)) + _FOLD_GROWTH
        if not isinstance(value, mx.array) or value.nbytes > budget:
            left.append(step)
            continue
        value = mx.contiguous(value)
        mx.eval(value)
        constants[step.name] = value
    read = set(refs([[(s.args, s.kwargs) for s in left], list(kept)])) | set(kept)
    for name in [n for n in constants if n not in read]:
        del constants[name]
    return left


class FusionsSkippedWarning(UserWarning):
    """A step of an MLX blob could not be traced at ``init``: no fusion (RMSNorm, attention,
    RoPE) is matched over its value or any value made from it; the program still runs,
    interpreted step by step."""


def _lazy_info(
    program: DelegateProgram, steps: Sequence[Step], constants: Mapping[str, Any], state: Mapping[str, Any]
) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Each value's shape and dtype, from the traced steps on placeholder inputs, nothing
    evaluated. A scalar input has no static value, so a step reading it (and every step
    after it reading its value) is left out; a step that raises when traced is left out the
    same way, with a :class:`FusionsSkippedWarning` naming it. No pattern is matched over
    the values left out."""
    env: dict[str, Any] = {**constants, **state}
    untraced = set()
    for name, meta in zip(program.inputs, program.input_meta, strict=True):
        if "scalar" in meta:
            untraced.add(name)
        else:
            env[name] = mx.zeros(meta["shape"], dtype=mlx_dtype(meta["dtype"]))
    for position, step in enumerate(steps):
        if untraced & set(refs((step.args, step.kwargs))):
            untraced.add(step.name)
            continue
        try:
            env[step.name] = call_resolved(step, env, True)
        except (ValueError, TypeError, IndexError) as error:
            untraced.add(step.name)
            warnings.warn(
                f"MLX delegate: step {position} {step.name!r} ({step.op}) could not be traced at init "
                f"({type(error).__name__}: {error}); no RMSNorm, attention or RoPE fusion is matched over "
                "its value or any value made from it (the program still runs, interpreted)",
                FusionsSkippedWarning,
                stacklevel=2,
            )
    return {k: (tuple(v.shape), v.dtype) for k, v in env.items() if isinstance(v, mx.array)}


class MLXDelegate(CompiledPath, InterpretedPath):
    """The runtime side of the MLX backend (a ``writeback_core.RuntimeDelegate``).

    ``execute`` runs a call on the handle's traced step (:class:`CompiledPath`) when it can,
    else interprets the program (:class:`InterpretedPath`); what the delegate counts over its
    calls (``evaluations_total``, ``copied_input_bytes`` and the rest) is set up by
    :class:`~writeback_mlx_backend.calls.Calls`.
    """

    backend_id = BACKEND_ID
    # The blob as a view of the runtime's buffer, not a bytes copy: its weights are copied
    # once, into MLX arrays (MLX's Python API has no array over memory it does not own).
    processed_as_memoryview = True

    def init(self, processed: bytes | memoryview, compile_specs: Mapping[str, bytes]) -> Handle:
        """Parse the blob, load weights into MLX and precompute value lifetimes."""
        program = DelegateProgram.from_bytes(processed)
        steps = []
        for position, node in enumerate(program.nodes):
            handler = OPS.get(node["op"])
            if handler is None:
                raise BlobError(
                    DELEGATE, f"nodes[{position}].op", node["op"], "not an op this runtime has a handler for"
                )
            if node["op"].startswith("dim_order_ops."):
                import executorch.exir.passes.dim_order_ops_registry  # noqa: F401  (registers their schemas)
            dtype = mlx_dtype(node["dtype"]) if node["dtype"] else None
            args, kwargs = _decode(node["args"]), _decode(node["kwargs"])
            check_call(node["op"], args, kwargs, DELEGATE, f"nodes[{position}]", _kind)
            steps.append(Step(node["name"], node["op"], handler, args, kwargs, dtype))
        records = {name: (r.shape, r.dtype) for name, r in [*program.constants.items(), *program.state.items()]}
        check_literals(steps, dict(zip(program.inputs, program.input_meta, strict=True)), records)
        steps, renames = _fold_aliases(steps)
        outputs = _rename(_decode(program.outputs), renames)
        state_updates = {k: renames.get(v, v) for k, v in program.state_updates.items()}
        constants = {k: _load(program, r) for k, r in program.constants.items()}
        kept = [*refs(outputs), *state_updates.values()]
        steps = _fold_constants(steps, constants, kept)
        steps, norms = fuse_rms_norms(steps, constants, kept)
        state = {k: _load(program, r) for k, r in program.state.items()}
        info = _lazy_info(program, steps, constants, state)
        steps, attentions = fuse_attention(steps, info, constants, kept)
        steps, ropes = fuse_ropes(steps, info, constants, kept)
        end = len(steps)
        last_use: dict[str, int] = {}
        for position, step in enumerate(steps):
            for name in refs((step.args, step.kwargs)):
                last_use[name] = position
        for name in [*refs(outputs), *state_updates.values()]:
            last_use[name] = end
        dies_at: list[list[str]] = [[] for _ in range(end + 1)]
        for name, position in last_use.items():
            if name not in constants:
                dies_at[position].append(name)
        mx.eval(*constants.values(), *state.values())
        program.drop_data()  # every record is an MLX array of its own now: the blob can go
        watch = memory_plan(program, steps, last_use)
        forced, whole = _forced(program, compile_specs, outputs, info)
        handle = Handle(
            program,
            steps,
            constants,
            state,
            outputs,
            last_use,
            dies_at,
            list(program.in_place),
            forced,
            watch,
            state_updates,
            whole,
        )
        handle.compiled, handle.path = compile_step(handle)
        if norms:
            handle.path += f"; {norms} RMSNorm(s) as mx.fast.rms_norm"
        if attentions:
            handle.path += f"; {attentions} attention(s) as mx.fast.scaled_dot_product_attention"
        if ropes:
            handle.path += f"; {ropes} RoPE(s) as mx.fast.rope"
        self.execution_paths.append(handle.path)
        return handle

    @staticmethod
    def path(handle: Handle) -> str:
        """``"compiled"``, or ``"interpreted: <why>"``: how ``execute`` runs this handle."""
        return handle.path

    def destroy(self, handle: Handle) -> None:
        """Drop the handle's MLX arrays."""
        handle.constants.clear()
        handle.state.clear()

    # -- execute --------------------------------------------------------------------

    def execute(self, handle: Handle, args: Sequence[Any]) -> None:
        """Run the program once on ``args`` (inputs then outputs, see the module docstring)."""
        program = handle.program
        count = len(program.inputs)
        inputs, outputs = list(args[:count]), list(args[count:])
        if len(outputs) != len(handle.outputs):
            raise ValueError(
                f"MLX delegate expects {count} inputs and {len(handle.outputs)} outputs, got "
                f"{len(args)} arguments in all"
            )
        for output, input_ in handle.whole:
            # The write-back of this input was dropped: its new value goes into its memory.
            outputs[output] = inputs[input_]
        compiled = handle.compiled
        if (
            compiled is not None
            and not any(same_memory(outputs[c.output], inputs[c.input]) for c in handle.optional)
            and self._execute_compiled(handle, compiled, inputs, outputs)
        ):
            return
        self._execute_interpreted(handle, inputs, outputs)
