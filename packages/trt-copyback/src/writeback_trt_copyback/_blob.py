"""The processed blob of the kv-alias engine: a JSON program of aten calls and in-place updates.

Private to the engine: written by its ``preprocess``, read by its runtime delegate
and by ``KVAliasEngine.aliased_io``. Values are referenced by node name; tensors
that the partition owns (none, unless a partitioner tags constants) travel as raw
bytes in base64 with their dtype and shape.

A blob is file content, so :meth:`Blob.from_bytes` checks every field with
:mod:`writeback_core.blob` and :func:`compile_args` turns arguments into values
through tables only: an op name must be in :data:`OPS` (the ops the partitioner
hands the engine, so the only ones ``preprocess`` writes), a dtype, layout,
memory format or device must be one of core's names. Nothing in a blob reaches
``getattr``, ``torch.load`` or ``eval``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from writeback_core.blob import (
    DEVICES,
    DTYPES,
    LAYOUTS,
    MEMORY_FORMATS,
    BlobError,
    BlobReader,
    OpTable,
    Ref,
    dtype_name,
    load_json,
    tensor_from_bytes,
    tensor_to_bytes,
)
from writeback_core.ops import overload_name

FORMAT = "writeback-kv-alias/2"  # 2: constants as raw bytes with dtype and shape (1 held torch.save bytes)
DELEGATE = "kv-alias"

# How a non-JSON argument is spelled: a one-key dict whose key says what it is.
_REF, _DICT, _DTYPE, _DEVICE, _MEMFMT, _LAYOUT = "$ref", "$dict", "$dtype", "$device", "$memory_format", "$layout"
_TABLES: dict[str, tuple[dict[str, Any], str]] = {
    _DTYPE: (dict(DTYPES), "dtype"),
    _DEVICE: (dict(DEVICES), "device"),
    _MEMFMT: (dict(MEMORY_FORMATS), "memory format"),
    _LAYOUT: (dict(LAYOUTS), "layout"),
}
UPDATES = ("slice", "index_put", "index_copy")


@dataclass
class Blob:
    """A lowered partition: ``steps`` run in order over the delegate's inputs."""

    inputs: list[str]
    steps: list[dict[str, Any]]
    outputs: list[Any]
    aliased_io: dict[str, int] = field(default_factory=dict)
    marked: list[str] = field(default_factory=list)
    constants: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, **self.__dict__}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Blob:
        """Parse and check the structure of every field; :class:`BlobError` (a ``ValueError``) otherwise."""
        read = BlobReader(DELEGATE)
        record = load_json(data, DELEGATE)
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            found = record.get("format") if isinstance(record, dict) else record
            raise BlobError(DELEGATE, "format", found, f"not a kv-alias engine blob (expected format {FORMAT!r})")
        read.record(record, "blob", keys=("format", "inputs", "steps", "outputs", "aliased_io", "marked", "constants"))
        inputs = read.strings(record["inputs"], "inputs")
        steps = [read.record(s, f"steps[{i}]") for i, s in enumerate(read.items(record["steps"], "steps"))]
        for i, step in enumerate(steps):
            read.string(read.get(step, "name", f"steps[{i}]"), f"steps[{i}].name")
        aliased = read.record(record["aliased_io"], "aliased_io")
        for key, value in aliased.items():
            read.integer(value, f"aliased_io[{key!r}]", 0, len(inputs))
        constants = read.record(record["constants"], "constants")
        for key, value in constants.items():
            read.record(value, f"constants[{key!r}]", keys=("dtype", "shape", "data"))
        return cls(
            inputs=inputs,
            steps=steps,
            outputs=read.items(record["outputs"], "outputs"),
            aliased_io=dict(aliased),
            marked=read.strings(record["marked"], "marked"),
            constants=dict(constants),
        )


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as ``{"dtype", "shape", "data"}`` with its raw bytes in base64."""
    return {
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "data": base64.b64encode(tensor_to_bytes(tensor)).decode(),
    }


def decode_tensor(record: dict[str, Any], field: str) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`; every field checked."""
    text = BlobReader(DELEGATE).string(record["data"], f"{field}.data")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BlobError(DELEGATE, f"{field}.data", text, "not base64") from None
    return tensor_from_bytes(raw, record["dtype"], record["shape"], DELEGATE, field)


def encode_arg(value: Any) -> Any:
    """A graph argument as JSON; nodes become references by name."""
    if isinstance(value, torch.fx.Node):
        return {_REF: value.name}
    if isinstance(value, (list, tuple)):
        return [encode_arg(v) for v in value]
    if isinstance(value, dict):
        return {_DICT: {k: encode_arg(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {_DTYPE: dtype_name(value)}
    if isinstance(value, torch.device):
        return {_DEVICE: str(value)}
    if isinstance(value, torch.memory_format):
        return {_MEMFMT: str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {_LAYOUT: str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"the kv-alias engine cannot serialize argument {value!r} ({type(value).__name__})")


def compile_arg(value: Any, defined: set[str], field: str) -> Any:
    """Inverse of :func:`encode_arg`, checked: references must name a value defined earlier,
    every tagged value must be in its table. Returns plain values with :class:`Ref` leaves."""
    read = BlobReader(DELEGATE)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [compile_arg(v, defined, f"{field}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict) or len(value) != 1:
        raise read.fail(field, value, "expected a JSON scalar, a list or a one-key tagged object")
    ((tag, inner),) = value.items()
    if tag == _REF:
        name = read.string(inner, f"{field}.{_REF}")
        if name not in defined:
            raise read.fail(f"{field}.{_REF}", name, "names no input, constant or earlier step")
        return Ref(name)
    if tag == _DICT:
        entries = read.record(inner, f"{field}.{_DICT}")
        compiled = {k: compile_arg(v, defined, f"{field}.{_DICT}.{k}") for k, v in entries.items()}
        for key, check in _ENTRY_CHECKS.items():
            if key in compiled:
                check(read, compiled[key], f"{field}.{_DICT}.{key}")
        return compiled
    if tag in _TABLES:
        table, what = _TABLES[tag]
        return read.lookup(table, inner, f"{field}.{tag}", what)
    raise read.fail(field, tag, f"unknown tag (known: {sorted([_REF, _DICT, *_TABLES])})")


def _check_dim_order(read: BlobReader, value: Any, field: str) -> None:
    """A ``dim_order`` (of ``_to_dim_order_copy``, ``_clone_dim_order``) must be one exir maps
    to a memory format: none, contiguous (``[0, 1, .., n-1]``) or channels-last
    (``[0, 2, 3, 1]``); exir's kernels assert on any other."""
    if value is None:
        return
    items = read.items(value, field)
    if items != list(range(len(items))) and items != [0, 2, 3, 1]:
        raise read.fail(field, items, "a dim order must be contiguous [0, 1, .., n-1] or channels-last [0, 2, 3, 1]")


# Checks of named entries of a keyword-argument dict, by name: literals whose every
# value the kernel does not itself refuse cleanly.
_ENTRY_CHECKS: dict[str, Callable[[BlobReader, Any, str], None]] = {"dim_order": _check_dim_order}


def engine_op_key(target: Any) -> str:
    """The name the engine's blob gives a step: ``aten.add.Tensor`` for an op (or its edge
    wrapper), ``getitem`` for ``operator.getitem``; the engine runs nothing else.

    :raises TypeError: ``target`` is neither.
    """
    if target is operator.getitem:
        return "getitem"
    name = overload_name(target)
    if name is None:
        raise TypeError(f"the kv-alias engine cannot run {target!r}")
    return name


# The ops the engine runs, as ``namespace.name.overload``: the partitioner hands the
# engine nothing else, so ``preprocess`` writes nothing else and a blob naming any
# other op is refused. Chosen for what exported decoders and generated stateful
# programs use, all bounds-checked by their kernels; ops that make views of
# arbitrary memory (``as_strided``, ``set_``) or resize storage are left out.
_OP_NAMES = (
    *(
        f"aten.{name}.default"
        for name in (
            "abs neg exp log log1p expm1 sqrt rsqrt reciprocal sin cos tanh sigmoid relu gelu silu erf sign "
            "floor ceil round trunc logical_not bitwise_not clone copy alias _to_copy permute expand reshape t "
            "mm bmm addmm baddbmm cat stack embedding index_put slice_scatter index_copy select_scatter "
            "scalar_tensor full full_like arange zeros_like ones_like where _softmax _log_softmax "
            "native_layer_norm constant_pad_nd tril triu flip repeat cumsum minimum maximum logical_and "
            "logical_or logical_xor sum mean amax amin any all argmax argmin var clamp split_with_sizes "
            "index_select gather roll"
        ).split()
    ),
    *(
        f"aten.{name}.{overload}"
        for name in "add sub mul div eq ne lt le gt ge remainder fmod bitwise_and bitwise_or bitwise_xor".split()
        for overload in ("Tensor", "Scalar")
    ),
    "aten.div.Tensor_mode",
    "aten.pow.Tensor_Tensor",
    "aten.pow.Tensor_Scalar",
    "aten.arange.start",
    "aten.arange.start_step",
    "aten.where.self",
    "aten.clamp.Tensor",
    "aten.masked_fill.Scalar",
    "aten.masked_fill.Tensor",
    "aten.sum.dim_IntList",
    "aten.mean.dim",
    "aten.any.dim",
    "aten.any.dims",
    "aten.max.dim",
    "aten.min.dim",
    "aten.var.correction",
    "aten.transpose.int",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.unsqueeze.default",
    "aten.squeeze.dims",
    "aten.squeeze.dim",
    "aten.split.Tensor",
    "aten.unbind.int",
    "aten.index.Tensor",
    "aten.scatter.src",
    "aten.scatter.value",
    "aten.scatter_add.default",
    "aten.softmax.int",
    "aten.full.default",
    "dim_order_ops._to_dim_order_copy.default",
    "dim_order_ops._clone_dim_order.default",
)


def _overload(name: str) -> torch._ops.OpOverload | None:
    """The overload ``name`` (a constant of this module, never blob content), if torch has it."""
    namespace, packet, overload = name.split(".")
    try:
        found = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        return None
    return found if isinstance(found, torch._ops.OpOverload) else None


@functools.cache
def ops() -> OpTable:
    """The allow-list :data:`_OP_NAMES` as a table (built on first use: exir registers
    the ``dim_order_ops`` with torch when imported)."""
    import executorch.exir.passes.dim_order_ops_registry  # noqa: F401

    found = {name: _overload(name) for name in dict.fromkeys(_OP_NAMES)}
    missing = sorted(name for name, op in found.items() if op is None)
    if missing:
        raise RuntimeError(f"the kv-alias engine's op list names ops this torch does not have: {missing}")
    return OpTable(found.values(), named={"getitem": operator.getitem})
