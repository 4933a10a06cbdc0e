"""Reading a delegate blob as data: every value checked against a table, nothing run.

A ``.pte`` file is untrusted input. Its delegate blobs and compile specs reach a
runtime delegate's ``init`` as bytes; this module is what every delegate in
writeback (and any third-party one) decodes them with, so that no byte of a file
can choose which Python code runs:

1. JSON only (:func:`load_json`): no pickle, no ``torch.load``, no ``eval``.
2. Every field is read through :class:`BlobReader`, which checks its type and
   names the delegate and the field path when it is wrong.
3. Names that select behaviour are looked up in explicit tables, never with
   ``getattr``: ops in an :class:`OpTable` (an allow-list of the overloads the
   delegate's ``preprocess`` can emit), dtypes in :data:`DTYPES`, layouts,
   memory formats and devices in their own tables.
4. Tensor data is raw bytes with a dtype and shape, and its size must match
   (:func:`tensor_from_bytes`).

Anything else raises :class:`BlobError` naming the delegate, the field and the
value, before any op runs. Example it refuses: an op name
``"aten.add.Tensor.__class__"`` or ``"builtins.exec"`` (not in the table),
``{"$dtype": "__builtins__"}`` (not a dtype name).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

import torch

from writeback_core.meta import IN_PLACE_OUTPUTS_SPEC

__all__ = [
    "DEVICES",
    "DTYPES",
    "LAYOUTS",
    "MEMORY_FORMATS",
    "BlobError",
    "BlobReader",
    "InPlaceOutput",
    "Kind",
    "OpTable",
    "Ref",
    "check_call",
    "dtype_name",
    "encode_in_place_outputs",
    "in_place_outputs",
    "load_json",
    "resolve",
    "tensor_from_bytes",
    "tensor_to_bytes",
]

T = TypeVar("T")

# The dtypes a blob may name, by the name ``dtype_name`` gives them.
DTYPES: Mapping[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
LAYOUTS: Mapping[str, torch.layout] = {"strided": torch.strided}
MEMORY_FORMATS: Mapping[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "preserve_format": torch.preserve_format,
    "channels_last": torch.channels_last,
}
DEVICES: Mapping[str, torch.device] = {"cpu": torch.device("cpu")}

# The largest blob value worth printing in an error message.
_SHOWN = 80


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


class BlobError(ValueError):
    """A delegate blob (or compile spec) that is not what the delegate's ``preprocess`` writes.

    ``delegate`` names the delegate, ``field`` the path of the bad field in the
    blob (``"nodes[3].op"``), ``value`` what was found there.
    """

    def __init__(self, delegate: str, field: str, value: object, reason: str) -> None:
        self.delegate = delegate
        self.field = field
        self.value = value
        end = "" if reason.endswith((".", "?")) else "."
        super().__init__(
            f"{delegate} delegate blob: field {field} = {_show(value)}: {reason}{end} The .pte is corrupted, "
            "was changed by hand, or was written by another version of the backend; lower the model again"
        )


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``: the name :data:`DTYPES` and :meth:`BlobReader.dtype` take."""
    return str(dtype).removeprefix("torch.")


class OpTable:
    """An allow-list of callables a blob may name, keyed by the name the delegate writes.

    Built from ``torch._ops.OpOverload`` objects (keyed ``"aten.add.Tensor"``, as
    ``str(op)`` prints them) and from explicit ``{name: callable}`` entries. A blob
    can pick one of these and nothing else.
    """

    def __init__(self, ops: Iterable[Any] = (), named: Mapping[str, Callable[..., Any]] | None = None) -> None:
        self._table: dict[str, Callable[..., Any]] = {}
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"OpTable takes op overloads (torch.ops.aten.add.Tensor), got {op!r}")
            self._table[str(op)] = op
        self._table.update(named or {})

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._table

    def __len__(self) -> int:
        return len(self._table)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._table)

    def resolve(self, name: object, delegate: str, field: str) -> Callable[..., Any]:
        """The callable named ``name``; :class:`BlobError` for anything not in the table."""
        if not isinstance(name, str):
            raise BlobError(delegate, field, name, "an op name must be a string")
        found = self._table.get(name)
        if found is None:
            raise BlobError(delegate, field, name, f"not one of the {len(self._table)} ops this delegate runs")
        return found


def load_json(data: bytes | bytearray | memoryview, delegate: str, field: str = "blob") -> Any:
    """Parse JSON (UTF-8) from a blob; :class:`BlobError` on anything else.

    That includes JSON that Python will not read: nesting deeper than the
    recursion limit, and an integer longer than the int-string conversion limit
    (4,300 digits by default), which ``json`` raises as a plain ``ValueError``.
    """
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (ValueError, RecursionError) as error:  # ValueError covers UnicodeDecodeError and JSONDecodeError
        raise BlobError(delegate, field, bytes(data[:16]), f"not UTF-8 JSON that Python reads ({error})") from None


class BlobReader:
    """Typed access to decoded JSON, each error naming the delegate and the field path."""

    def __init__(self, delegate: str) -> None:
        self.delegate = delegate

    def fail(self, field: str, value: object, reason: str) -> BlobError:
        """The error to raise for ``value`` at ``field``."""
        return BlobError(self.delegate, field, value, reason)

    def record(self, value: object, field: str, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """A JSON object with string keys; with ``keys``, exactly those keys."""
        if not isinstance(value, dict):
            raise self.fail(field, value, "expected an object")
        if keys is not None:
            wanted = set(keys)
            if set(value) != wanted:
                missing, extra = sorted(wanted - set(value)), sorted(set(value) - wanted)
                raise self.fail(
                    field, sorted(value), f"expected the keys {sorted(wanted)} (missing {missing}, extra {extra})"
                )
        return value

    def get(self, record: Mapping[str, Any], key: str, field: str) -> Any:
        """``record[key]``, or :class:`BlobError` naming ``field.key`` when absent."""
        if key not in record:
            raise self.fail(f"{field}.{key}", None, "missing")
        return record[key]

    def string(self, value: object, field: str) -> str:
        if not isinstance(value, str):
            raise self.fail(field, value, "expected a string")
        return value

    def boolean(self, value: object, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, value, "expected true or false")
        return value

    def integer(self, value: object, field: str, low: int | None = None, high: int | None = None) -> int:
        """An int (not a bool) in ``[low, high)`` where given."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, value, "expected an integer")
        if (low is not None and value < low) or (high is not None and value >= high):
            bounds = f"[{'' if low is None else low}, {'' if high is None else high})"
            raise self.fail(field, value, f"out of range {bounds}")
        return value

    def number(self, value: object, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, value, "expected a number")
        return float(value)

    def items(self, value: object, field: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(field, value, "expected a list")
        return value

    def strings(self, value: object, field: str) -> list[str]:
        return [self.string(v, f"{field}[{i}]") for i, v in enumerate(self.items(value, field))]

    def shape(self, value: object, field: str) -> tuple[int, ...]:
        return tuple(self.integer(v, f"{field}[{i}]", low=0) for i, v in enumerate(self.items(value, field)))

    def lookup(self, table: Mapping[str, T], value: object, field: str, what: str) -> T:
        """``table[value]`` for a string key; :class:`BlobError` listing the known keys otherwise."""
        if isinstance(value, str) and value in table:
            return table[value]
        raise self.fail(field, value, f"not a known {what} (known: {sorted(table)})")

    def dtype(self, value: object, field: str) -> torch.dtype:
        return self.lookup(DTYPES, value, field, "dtype")


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's elements as raw bytes, C order (what :func:`tensor_from_bytes` reads)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else b""


def tensor_from_bytes(
    data: bytes | bytearray | memoryview,
    dtype: object,
    shape: object,
    delegate: str,
    field: str,
) -> torch.Tensor:
    """A new tensor (owning its memory) from raw bytes, its dtype name and shape all checked.

    :raises BlobError: unknown dtype, a shape that is not a list of non-negative
        ints, or a byte count that is not exactly what the shape needs.
    """
    reader = BlobReader(delegate)
    torch_dtype = reader.dtype(dtype, f"{field}.dtype")
    dims = reader.shape(shape, f"{field}.shape")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    need = math.prod(dims) * itemsize
    if len(data) != need:
        raise reader.fail(f"{field}.data", f"{len(data)} bytes", f"shape {list(dims)} of {dtype} needs {need} bytes")
    if need == 0:
        return torch.empty(dims, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(dims)


class InPlaceOutput(NamedTuple):
    """One entry of the in-place compile spec: the delegate writes its output ``output``
    into its input ``input`` in place (and leaves the output itself unwritten)."""

    output: int
    input: int


def encode_in_place_outputs(pairs: Iterable[tuple[int, int]]) -> bytes:
    """The value of the :data:`~writeback_core.meta.IN_PLACE_OUTPUTS_SPEC` compile spec
    for ``(output, input)`` pairs: what :func:`in_place_outputs` reads back."""
    return json.dumps([{"output": int(output), "input": int(input_)} for output, input_ in pairs]).encode()


def in_place_outputs(
    compile_specs: Mapping[str, bytes], delegate: str, num_inputs: int, num_outputs: int
) -> list[InPlaceOutput]:
    """The in-place compile spec of a lowered module, as a runtime delegate's ``init`` reads it.

    The spec (key :data:`~writeback_core.meta.IN_PLACE_OUTPUTS_SPEC`) is added by
    the pass that drops a write-back of state the backend accepted to write in
    place (``writeback_accepts_in_place``); each entry tells the delegate to
    write its output ``output`` into its input ``input`` in place. Every runtime
    delegate reads it with this function, the only parser of the spec. A
    delegate that cannot honour an entry must refuse it in ``init``: leaving the
    output unwritten and the input unchanged would lose the write.

    :param compile_specs: the lowered module's compile specs, as ``init`` receives them.
    :param delegate: the delegate's name, for error messages.
    :param num_inputs: how many inputs the delegate takes (each ``input`` is checked below it).
    :param num_outputs: how many outputs it returns (each ``output`` is checked below it).
    :return: the entries in spec order; ``[]`` when the spec is absent.
    :raises BlobError: the spec is not a JSON list of ``{"output": k, "input": i}`` with
        ``k`` and ``i`` in range, or names one output twice.
    """
    raw = compile_specs.get(IN_PLACE_OUTPUTS_SPEC)
    if raw is None:
        return []
    reader = BlobReader(delegate)
    field = f"compile_specs[{IN_PLACE_OUTPUTS_SPEC!r}]"
    entries = reader.items(load_json(raw, delegate, field), field)
    pairs: list[InPlaceOutput] = []
    for k, entry in enumerate(entries):
        where = f"{field}[{k}]"
        record = reader.record(entry, where, keys=("output", "input"))
        output = reader.integer(record["output"], f"{where}.output", 0, num_outputs)
        input_ = reader.integer(record["input"], f"{where}.input", 0, num_inputs)
        if any(p.output == output for p in pairs):
            raise reader.fail(f"{where}.output", output, "this output is already written in place by an earlier entry")
        pairs.append(InPlaceOutput(output, input_))
    return pairs


# What a decoded argument leaf is, as far as a schema cares: a reference to a value
# computed at run time, one of the enumerations, or ``None`` for a plain JSON value.
Kind = Literal["ref", "dtype", "layout", "device", "memory_format"] | None
_ENUM_TYPES = {"ScalarType": "dtype", "Layout": "layout", "Device": "device", "MemoryFormat": "memory_format"}


def _type_error(type_name: str, value: Any, kind_of: Callable[[Any], Kind]) -> str | None:
    """Why ``value`` cannot be an argument of schema type ``type_name``, or ``None``."""
    kind = kind_of(value)
    if type_name.startswith("Optional[") and type_name.endswith("]"):
        return None if value is None else _type_error(type_name[9:-1], value, kind_of)
    if kind == "ref":
        # A value computed at run time: its kernel checks it. Only lists must be literal.
        return "expected a literal list, not a reference" if type_name.startswith("List[") else None
    if type_name.startswith("List[") and type_name.endswith("]"):
        if not isinstance(value, list):
            return f"expected a list ({type_name})"
        errors = (_type_error(type_name[5:-1], item, kind_of) for item in value)
        return next((e for e in errors if e is not None), None)
    if type_name in _ENUM_TYPES:
        return None if kind == _ENUM_TYPES[type_name] else f"expected a {_ENUM_TYPES[type_name]} name"
    plain = kind is None
    # Kernels take 64-bit ints: a larger literal would escape them as OverflowError.
    int64 = plain and isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    number = int64 or (plain and isinstance(value, float))
    accepted = {
        "Tensor": False,
        "int": int64,
        "SymInt": int64,
        "float": number,
        "number": number or (plain and isinstance(value, bool)),
        "bool": plain and isinstance(value, bool),
        "str": plain and isinstance(value, str),
    }
    if type_name not in accepted:
        return f"argument type {type_name} is not one a blob may carry"
    wanted = {"Tensor": "a reference to a tensor", "int": "a 64-bit int", "SymInt": "a 64-bit int"}.get(
        type_name, type_name
    )
    return None if accepted[type_name] else f"expected {wanted}"


def check_call(
    op_name: str,
    args: list[Any],
    kwargs: Mapping[str, Any],
    delegate: str,
    field: str,
    kind_of: Callable[[Any], Kind],
) -> None:
    """Check decoded ``args``/``kwargs`` of a call against the schema of ``op_name``.

    ``op_name`` is ``"aten.add.Tensor"`` and must already have passed the
    delegate's :class:`OpTable` (the schema is looked up in torch's operator
    registry by name, no attribute access). Each literal must have its
    parameter's type; a ``Tensor`` parameter takes only a reference; references
    are values of the run and are left to the kernel.

    :raises BlobError: naming ``field.args[i]`` or ``field.kwargs.name``.
    """
    namespace, name, overload = op_name.split(".")
    try:
        schema = torch._C._get_schema(f"{namespace}::{name}", "" if overload == "default" else overload)
    except RuntimeError:
        raise BlobError(delegate, f"{field}.op", op_name, "torch has no schema for this op") from None
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise BlobError(delegate, f"{field}.args", len(args), f"{op_name} takes {len(positional)} positional arguments")
    by_name = {a.name: a for a in schema.arguments}
    given = {a.name: (f"{field}.args[{i}]", v) for i, (a, v) in enumerate(zip(positional, args, strict=False))}
    for key, value in kwargs.items():
        if key not in by_name or key in given:
            raise BlobError(delegate, f"{field}.kwargs", key, f"not a keyword argument of {op_name}")
        given[key] = (f"{field}.kwargs.{key}", value)
    for argument in schema.arguments:
        if argument.name not in given:
            if not argument.has_default_value():
                raise BlobError(delegate, f"{field}.args", argument.name, f"{op_name} needs this argument")
            continue
        where, value = given[argument.name]
        reason = _type_error(str(argument.real_type), value, kind_of)
        if reason is not None:
            raise BlobError(delegate, where, value, f"{reason} for {argument.name} of {op_name}")


@dataclass(frozen=True)
class Ref:
    """A decoded argument that names a value of the delegate's program (an input, a constant,
    a state or an earlier step), not the value itself."""

    name: str


def resolve(value: Any, env: Mapping[str, Any]) -> Any:
    """``value`` with each :class:`Ref` (inside lists and dicts too) replaced by ``env[ref.name]``."""
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, list):
        return [resolve(v, env) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, env) for k, v in value.items()}
    return value
