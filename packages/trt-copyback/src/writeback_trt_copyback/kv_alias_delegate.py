"""The kv-alias engine's runtime delegate, offered through ``writeback_runtime_delegates``.

A runtime (the pybind-runtime) registers it as an ExecuTorch backend and calls
``execute`` with zero-copy tensor views of the delegate's arguments: the
inputs, then the outputs, already allocated.

It writes an input only where its lowering declared it, as every delegate must
(``writeback_core.types.RuntimeDelegate``): the blob's ``aliased_io`` is that
declaration (the copy-back path drops exactly those write-backs), and ``init``
refuses a blob whose update steps and ``aliased_io`` disagree, either way,
before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from writeback_core.blob import BlobError, BlobReader, Kind, Ref, check_call, in_place_outputs, resolve
from writeback_core.meta import IN_PLACE_OUTPUTS_SPEC
from writeback_core.ops import normalize_dim

from writeback_trt_copyback._blob import DELEGATE, UPDATES, Blob, compile_arg, decode_tensor, ops
from writeback_trt_copyback.engine import BACKEND_ID

__all__ = ["KVAliasRuntimeDelegate"]


@dataclass(frozen=True)
class _Call:
    """``name = op(*args, **kwargs)``, arguments compiled (``_blob.Ref`` leaves)."""

    name: str
    op: Callable[..., Any]
    args: list[Any]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class _Update:
    """Write ``src`` into delegate input ``input`` in place, only the slots it covers."""

    name: str
    input: int
    kind: str
    src: Any
    dim: int = 0
    start: int = 0
    length: int = 0
    index: Any = None


@dataclass
class _Plan:
    blob: Blob
    steps: list[_Call | _Update]
    outputs: list[Any]
    constants: dict[str, torch.Tensor]
    skipped_outputs: frozenset[int]


def _tensor_ref(value: Any, defined: set[str], field: str) -> Ref:
    """An update's source or index: always a reference to a value of the partition."""
    found = compile_arg(value, defined, field)
    if not isinstance(found, Ref):
        raise BlobError(DELEGATE, field, value, 'expected a reference {"$ref": name}')
    return found


def _compile_update(step: dict[str, Any], where: str, n_inputs: int, defined: set[str]) -> _Update:
    read = BlobReader(DELEGATE)
    kind = read.lookup({k: k for k in UPDATES}, step["update"], f"{where}.update", "update")
    keys = {
        "slice": ("name", "input", "update", "dim", "start", "length", "src"),
        "index_put": ("name", "input", "update", "indices", "src"),
        "index_copy": ("name", "input", "update", "dim", "index", "src"),
    }[kind]
    read.record(step, where, keys=keys)
    src = _tensor_ref(step["src"], defined, f"{where}.src")
    position = read.integer(step["input"], f"{where}.input", 0, n_inputs)
    if kind == "slice":
        return _Update(
            step["name"],
            position,
            kind,
            src,
            dim=read.integer(step["dim"], f"{where}.dim", 0),
            start=read.integer(step["start"], f"{where}.start", 0),
            length=read.integer(step["length"], f"{where}.length", 0),
        )
    if kind == "index_put":
        indices = [
            None if i is None else _tensor_ref(i, defined, f"{where}.indices[{k}]")
            for k, i in enumerate(read.items(step["indices"], f"{where}.indices"))
        ]
        return _Update(step["name"], position, kind, src, index=indices)
    index = _tensor_ref(step["index"], defined, f"{where}.index")
    return _Update(step["name"], position, kind, src, dim=read.integer(step["dim"], f"{where}.dim", 0), index=index)


def _kind(value: Any) -> Kind:
    if isinstance(value, Ref):
        return "ref"
    if isinstance(value, torch.dtype):
        return "dtype"
    if isinstance(value, torch.layout):
        return "layout"
    if isinstance(value, torch.device):
        return "device"
    if isinstance(value, torch.memory_format):
        return "memory_format"
    return None


def _compile(blob: Blob) -> tuple[list[_Call | _Update], list[Any]]:
    """Every step checked and its op looked up in ``_blob.ops()``, before anything runs."""
    read = BlobReader(DELEGATE)
    defined = set(blob.inputs) | set(blob.constants)
    steps: list[_Call | _Update] = []
    for i, step in enumerate(blob.steps):
        where = f"steps[{i}]"
        if "update" in step:
            steps.append(_compile_update(step, where, len(blob.inputs), defined))
        else:
            read.record(step, where, keys=("name", "op", "args", "kwargs"))
            op = ops().resolve(step["op"], DELEGATE, f"{where}.op")
            args = compile_arg(read.items(step["args"], f"{where}.args"), defined, f"{where}.args")
            kwargs = compile_arg(read.record(step["kwargs"], f"{where}.kwargs"), defined, f"{where}.kwargs")
            if not isinstance(kwargs, dict):
                raise read.fail(f"{where}.kwargs", step["kwargs"], "expected a tagged $dict object")
            if step["op"] == "getitem":
                if len(args) != 2 or kwargs or not isinstance(args[0], Ref) or _kind(args[1]) is not None:
                    raise read.fail(f"{where}.args", step["args"], "getitem takes a reference and an index")
                read.integer(args[1], f"{where}.args[1]")
            else:
                check_call(step["op"], args, kwargs, DELEGATE, where, _kind)
            steps.append(_Call(step["name"], op, args, kwargs))
        defined.add(step["name"])
    outputs = [compile_arg(o, defined, f"outputs[{k}]") for k, o in enumerate(blob.outputs)]
    for k, output in enumerate(outputs):
        if isinstance(output, (list, dict, str)) or _kind(output) not in (None, "ref"):
            raise read.fail(f"outputs[{k}]", blob.outputs[k], "an output is a reference or a number")
    return steps, outputs


def _skipped_outputs(blob: Blob, n_outputs: int) -> frozenset[int]:
    """Outputs the engine leaves untouched because an input already holds them (``output<k>``)."""
    read = BlobReader(DELEGATE)
    skipped = set()
    for binding in blob.aliased_io:
        if binding.startswith("update:"):
            continue
        digits = binding.removeprefix("output")
        if binding == digits or not digits.isdigit():
            raise read.fail("aliased_io", binding, "a binding is output<k> or update:<step>")
        skipped.add(read.integer(int(digits), f"aliased_io[{binding!r}]", 0, n_outputs))
    return frozenset(skipped)


def _check_in_place_spec(blob: Blob, compile_specs: Mapping[str, bytes], n_outputs: int) -> None:
    """Refuse an in-place compile spec entry the engine's own aliasing does not already perform.

    The engine writes in place exactly what its rule aliased (``aliased_io``); an
    entry asking for any other write could not be honoured, and ignoring it would
    leave that output unwritten and its input unchanged.
    """
    aliased = {int(b.removeprefix("output")): i for b, i in blob.aliased_io.items() if not b.startswith("update:")}
    for entry in in_place_outputs(compile_specs, DELEGATE, len(blob.inputs), n_outputs):
        if aliased.get(entry.output) != entry.input:
            raise BlobError(
                DELEGATE,
                f"compile_specs[{IN_PLACE_OUTPUTS_SPEC!r}]",
                entry._asdict(),
                f"the engine aliased only {sorted(aliased.items())} (output, input); a write-back was "
                "dropped for a write it does not perform in place",
            )


def _check_declared_writes(blob: Blob, steps: Sequence[_Call | _Update], outputs: Sequence[Any]) -> None:
    """Every input the delegate writes is declared in ``aliased_io``, and every declaration is written.

    An update step writing an undeclared input would change state the program still
    copies back (or reads the old value of); a declared write no step performs would
    leave that state stale, its write-back dropped.
    """
    updates = {step.name: step for step in steps if isinstance(step, _Update)}
    returned = {o.name: k for k, o in reversed(list(enumerate(outputs))) if isinstance(o, Ref)}
    for name, step in updates.items():
        binding = f"output{returned[name]}" if name in returned else f"update:{name}"
        if blob.aliased_io.get(binding) != step.input:
            raise BlobError(
                DELEGATE,
                f"steps[{name!r}]",
                {"input": step.input, "binding": binding},
                f"the update writes input {step.input} in place, but aliased_io declares "
                f"{binding} -> {blob.aliased_io.get(binding)}; a delegate writes only the inputs its lowering declared",
            )
    for binding, input_index in blob.aliased_io.items():
        name = binding.removeprefix("update:")
        if binding.startswith("output"):
            ref = outputs[int(binding.removeprefix("output"))]  # range checked by _skipped_outputs
            name = ref.name if isinstance(ref, Ref) else ""
        written = updates.get(name)
        if written is None or written.input != input_index:
            raise BlobError(
                DELEGATE,
                f"aliased_io[{binding!r}]",
                input_index,
                f"declares input {input_index} written in place, but no update step writes it "
                f"(update steps: {sorted((s.name, s.input) for s in updates.values())}); its write-back "
                "was dropped for a write the delegate would not perform",
            )


def _check_slots(step: _Update, cache: torch.Tensor, src: Any) -> None:
    """Before a slice update writes: its slots lie inside ``cache`` and ``src`` fills them exactly.

    ``copy_`` would broadcast a smaller ``src`` over the slots, a silent wrong
    answer; a region past the cache's end would fail after nothing was checked.
    """
    where = f"kv-alias delegate: slice update {step.name!r} into input {step.input}"
    if not isinstance(src, torch.Tensor):
        raise ValueError(f"{where}: its value is a {type(src).__name__}, not a tensor")
    if step.dim >= cache.dim() or step.start + step.length > cache.shape[step.dim]:
        raise ValueError(
            f"{where}: slots {step.start}:{step.start + step.length} of dim {step.dim} lie outside "
            f"the input of shape {list(cache.shape)}; the blob does not fit the program it was loaded with"
        )
    expected = [step.length if d == step.dim else n for d, n in enumerate(cache.shape)]
    if list(src.shape) != expected:
        raise ValueError(
            f"{where}: expected a value of shape {expected} for slots {step.start}:{step.start + step.length} "
            f"of dim {step.dim}, got {list(src.shape)}; this update wrote nothing (re-lower the model: the blob "
            "and its program disagree)"
        )


def _update(step: _Update, cache: torch.Tensor, env: dict[str, Any]) -> None:
    """Write one accepted cache update into ``cache`` in place (only the slots it covers)."""
    src = resolve(step.src, env)
    if step.kind == "slice":
        _check_slots(step, cache, src)
        cache.narrow(step.dim, step.start, step.length).copy_(src)
    elif step.kind == "index_put":
        torch.ops.aten.index_put_.default(cache, resolve(step.index, env), src)
    else:
        where = f"kv-alias delegate: index_copy update {step.name!r} into input {step.input}"
        dim = normalize_dim(step.dim, cache.dim(), what=f"{where}: its dim")
        cache.index_copy_(dim, resolve(step.index, env), src)


class KVAliasRuntimeDelegate:
    """``init`` / ``execute`` / ``destroy`` for blobs of ``WritebackKVAliasBackend``."""

    backend_id = BACKEND_ID

    def init(self, processed: bytes, compile_specs: Mapping[str, bytes]) -> _Plan:
        """Parse and check the whole blob; :class:`~writeback_core.blob.BlobError` before anything runs."""
        blob = Blob.from_bytes(processed)
        steps, outputs = _compile(blob)
        skipped = _skipped_outputs(blob, len(outputs))
        _check_declared_writes(blob, steps, outputs)
        _check_in_place_spec(blob, compile_specs, len(outputs))
        constants = {k: decode_tensor(v, f"constants[{k!r}]") for k, v in blob.constants.items()}
        return _Plan(blob, steps, outputs, constants, skipped)

    def execute(self, handle: _Plan, args: Sequence[Any]) -> None:
        blob = handle.blob
        n_in = len(blob.inputs)
        if len(args) != n_in + len(handle.outputs):
            raise ValueError(
                f"kv-alias delegate expects {n_in} inputs and {len(handle.outputs)} outputs, got {len(args)} arguments"
            )
        env: dict[str, Any] = dict(handle.constants)
        env.update(zip(blob.inputs, args[:n_in], strict=True))
        for step in handle.steps:
            if isinstance(step, _Update):
                cache = args[step.input]
                _update(step, cache, env)
                env[step.name] = cache
                continue
            env[step.name] = step.op(*resolve(step.args, env), **resolve(step.kwargs, env))
        for k, ref in enumerate(handle.outputs):
            if k in handle.skipped_outputs:
                continue
            out, value = args[n_in + k], resolve(ref, env)
            if isinstance(out, torch.Tensor) and isinstance(value, torch.Tensor):
                out.copy_(value)

    def destroy(self, handle: _Plan) -> None:
        handle.steps.clear()
        handle.constants.clear()
