"""The processed blob of the MLX delegate: a JSON graph followed by raw tensor bytes.

Layout: ``MAGIC`` (8 bytes), the header's length (little-endian u64), the
header (UTF-8 JSON, zlib-compressed: a decoder's graph is hundreds of nodes
whose names repeat, and the ``.pte`` should be no larger than stock
ExecuTorch's), then the data section. Tensors in the header name their
``offset`` and ``nbytes`` in the data section, their ``dtype`` (a torch dtype
name) and ``shape``; a tensor whose bytes are all zero (a KV cache before the
first call) is written ``{"zeros": true, "dtype", "shape"}`` instead, with no
bytes, and the runtime allocates it at ``init``. Node arguments are JSON values where ``{"$v": name}``
refers to another value and ``{"$dtype": name}`` to a dtype. No pickle: the blob
loads in any process that has this package and MLX.

``VERSION`` is bumped whenever the meaning of a field changes; a runtime
refuses a blob whose version it does not know.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from writeback_core.blob import DTYPES, BlobReader, dtype_name, load_json

__all__ = ["MAGIC", "MAX_HEADER_BYTES", "VERSION", "DelegateProgram", "InPlaceCandidate", "TensorRecord", "pack"]

MAGIC = b"WBMLX\x00\x00\x01"
VERSION = 2

DELEGATE = "mlx"

# The dtypes the MLX delegate computes in (a subset of core's blob dtypes).
_TORCH_DTYPES = {
    name: DTYPES[name] for name in ("float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
}
_HEADER_KEYS = (
    "version",
    "inputs",
    "input_meta",
    "outputs",
    "nodes",
    "constants",
    "state",
    "state_updates",
    "in_place",
)
# Tagged JSON values a node argument may hold (see the module docstring).
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name``; :class:`~writeback_core.blob.BlobError` naming the known ones otherwise."""
    return BlobReader(DELEGATE).lookup(_TORCH_DTYPES, name, "dtype", "MLX dtype")


def float_value(name: object) -> float:
    """The float a ``{"$float": name}`` tag stands for."""
    return BlobReader(DELEGATE).lookup(_FLOATS, name, "$float", "float spelling")


def _check_value(read: BlobReader, value: Any, defined: set[str], field: str) -> None:
    """A node argument: JSON scalars, lists, and the tags ``$v`` (a defined value),
    ``$dtype`` (a known dtype) and ``$float`` (inf, -inf, nan); nothing else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_value(read, item, defined, f"{field}[{i}]")
        return
    if not isinstance(value, dict) or len(value) != 1:
        raise read.fail(field, value, "expected a JSON scalar, a list or a one-key tagged object")
    ((tag, inner),) = value.items()
    if tag == "$v":
        if read.string(inner, f"{field}.$v") not in defined:
            raise read.fail(f"{field}.$v", inner, "names no input, constant, state or earlier node")
    elif tag == "$dtype":
        torch_dtype_at(read, inner, f"{field}.$dtype")
    elif tag == "$float":
        read.lookup(_FLOATS, inner, f"{field}.$float", "float spelling")
    else:
        raise read.fail(field, tag, "unknown tag (known: $v, $dtype, $float)")


def torch_dtype_at(read: BlobReader, name: object, field: str) -> torch.dtype:
    return read.lookup(_TORCH_DTYPES, name, field, "MLX dtype")


def _unique(read: BlobReader, names: list[str], what: str) -> set[str]:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise read.fail(what, name, "a name is used twice")
        seen.add(name)
    return seen


# The largest header a blob may inflate to (a 32-layer decoder's is under 1 MiB).
MAX_HEADER_BYTES = 64 << 20


def pack(header: dict[str, Any], data: bytes | bytearray | memoryview) -> bytes:
    """A blob of ``header`` (compressed) and the data section ``data``, made in one
    allocation: the data section (a model's delegated weights) is copied once, never
    through intermediate ``bytes`` (each a whole copy of the weights alive at the peak)."""
    text = zlib.compress(json.dumps(header, separators=(",", ":")).encode(), 9)
    return b"".join((MAGIC, struct.pack("<Q", len(text)), text, data))


def _inflate(read: BlobReader, packed: bytes | bytearray | memoryview) -> bytes:
    """The header's JSON text; refused when it is not zlib data or inflates past
    :data:`MAX_HEADER_BYTES` (it is never inflated further than that)."""
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(bytes(packed), MAX_HEADER_BYTES)
    except zlib.error as error:
        raise read.fail("header", bytes(packed[:16]), f"not zlib-compressed JSON ({error})") from None
    if inflater.unconsumed_tail:
        raise read.fail("header", f"more than {MAX_HEADER_BYTES} bytes", "a header inflates to at most that")
    if not inflater.eof or inflater.unused_data:
        raise read.fail("header", len(packed), "the compressed header is truncated or followed by other bytes")
    return text


def _input_meta(read: BlobReader, value: object, field: str) -> dict[str, Any]:
    record = read.record(value, field)
    if set(record) == {"scalar"}:
        read.boolean(record["scalar"], f"{field}.scalar")
        return record
    read.record(record, field, keys=("shape", "dtype"))
    read.shape(record["shape"], f"{field}.shape")
    torch_dtype_at(read, record["dtype"], f"{field}.dtype")
    return record


# MLX holds each dimension as a 32-bit int.
_MAX_DIM = 2**31 - 1


def _memory_bytes() -> int | None:
    """This machine's physical memory, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _zeros_record(read: BlobReader, raw: dict[str, Any], where: str) -> TensorRecord:
    """A ``{"zeros": true, "dtype", "shape"}`` record: checked, not yet allocated."""
    read.record(raw, where, keys=("zeros", "dtype", "shape"))
    if read.boolean(raw["zeros"], f"{where}.zeros") is not True:
        raise read.fail(f"{where}.zeros", False, "a record without bytes must be zeros; others give offset and nbytes")
    shape = read.shape(raw["shape"], f"{where}.shape")
    for axis, size in enumerate(shape):
        if size > _MAX_DIM:
            raise read.fail(f"{where}.shape[{axis}]", size, f"MLX dimensions hold at most {_MAX_DIM}")
    dtype = torch_dtype_at(read, raw["dtype"], f"{where}.dtype")
    return TensorRecord(0, math.prod(shape) * torch.empty((), dtype=dtype).element_size(), raw["dtype"], shape, True)


def _records(read: BlobReader, value: object, field: str, data_size: int) -> dict[str, TensorRecord]:
    """Tensor records: each inside the data section with exactly the bytes its dtype and
    shape need, or zeros of a size this machine can hold (all zero records together)."""
    records = {}
    zeros = 0
    for name, raw in read.record(value, field).items():
        where = f"{field}[{name!r}]"
        if isinstance(raw, dict) and "zeros" in raw:
            records[name] = record = _zeros_record(read, raw, where)
            zeros += record.nbytes
            memory = _memory_bytes()
            if memory is not None and zeros > memory:
                raise read.fail(
                    f"{where}.shape",
                    list(record.shape),
                    f"zeros of {field} would take {zeros} bytes, more than this machine's {memory} bytes of memory",
                )
            continue
        read.record(raw, where, keys=("offset", "nbytes", "dtype", "shape"))
        shape = read.shape(raw["shape"], f"{where}.shape")
        dtype = torch_dtype_at(read, raw["dtype"], f"{where}.dtype")
        nbytes = read.integer(raw["nbytes"], f"{where}.nbytes", 0)
        need = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes != need:
            raise read.fail(f"{where}.nbytes", nbytes, f"shape {list(shape)} of {raw['dtype']} needs {need} bytes")
        offset = read.integer(raw["offset"], f"{where}.offset", 0)
        if offset + nbytes > data_size:
            raise read.fail(
                f"{where}.offset", offset, f"{nbytes} bytes from there pass the data section's end ({data_size})"
            )
        records[name] = TensorRecord(offset, nbytes, raw["dtype"], shape)
    return records


@dataclass(frozen=True)
class TensorRecord:
    """Where a constant or initial state lives in the data section; with ``zeros``, nowhere:
    it is ``nbytes`` of zeros the runtime allocates."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    zeros: bool = False

    def to_json(self) -> dict[str, Any]:
        if self.zeros:
            return {"zeros": True, "dtype": self.dtype, "shape": list(self.shape)}
        return {"offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class InPlaceCandidate:
    """Delegate output ``output`` is ``node`` writing into delegate input ``input``.

    When the runtime hands the delegate the same memory for both, the delegate
    writes only the updated region into that memory.
    """

    output: int
    input: int
    node: str


@dataclass
class DelegateProgram:
    """The delegated subgraph in a form the runtime interprets with MLX.

    ``inputs`` are the value names of the delegate's arguments, in call order;
    ``outputs`` the value names of its results (or JSON literals), in order;
    ``constants`` weights and constant tensors; ``state`` delegate-owned mutable
    buffers (initial values) and ``state_updates`` which value each becomes
    after a call; ``nodes`` the ops in graph order as ``{"name", "op", "args",
    "kwargs", "dtype"}``.
    """

    inputs: list[str]
    input_meta: list[dict[str, Any]]
    outputs: list[Any]
    nodes: list[dict[str, Any]]
    constants: dict[str, TensorRecord] = field(default_factory=dict)
    state: dict[str, TensorRecord] = field(default_factory=dict)
    state_updates: dict[str, str] = field(default_factory=dict)
    in_place: list[InPlaceCandidate] = field(default_factory=list)
    data: bytearray | memoryview = field(default_factory=bytearray)
    # Where each distinct run of bytes already is in ``data`` (by digest), so a tensor
    # stored twice (each layer's copy of one Llama mask) is stored once. Not serialized.
    _stored: dict[bytes, int] = field(default_factory=dict, repr=False, compare=False)

    def header(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "inputs": self.inputs,
            "input_meta": self.input_meta,
            "outputs": self.outputs,
            "nodes": self.nodes,
            "constants": {k: v.to_json() for k, v in self.constants.items()},
            "state": {k: v.to_json() for k, v in self.state.items()},
            "state_updates": self.state_updates,
            "in_place": [vars(c) for c in self.in_place],
        }

    def to_bytes(self) -> bytes:
        """Serialize as ``MAGIC | len | zlib(JSON) | data``."""
        return pack(self.header(), self.data)

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> DelegateProgram:
        """Parse a blob made by :meth:`to_bytes`, checking every field.

        :raises BlobError: (a ``ValueError``) on any other bytes, naming the field.
        """
        read = BlobReader(DELEGATE)
        if bytes(blob[: len(MAGIC)]) != MAGIC:
            raise read.fail(
                "magic",
                bytes(blob[:8]),
                "not an MLX delegate blob made by writeback-mlx-backend; was it lowered by another backend?",
            )
        start = len(MAGIC) + 8
        if len(blob) < start:
            raise read.fail("header length", len(blob), f"the blob ends before byte {start}")
        (size,) = struct.unpack_from("<Q", blob, len(MAGIC))
        if size > len(blob) - start:
            raise read.fail("header length", size, f"longer than the {len(blob) - start} bytes that follow")
        header = read.record(load_json(_inflate(read, blob[start : start + size]), DELEGATE, "header"), "header")
        if header.get("version") != VERSION:
            raise read.fail(
                "version",
                header.get("version"),
                f"this runtime reads version {VERSION}; lower the model again with this writeback-mlx-backend",
            )
        read.record(header, "header", keys=_HEADER_KEYS)
        # A view of the blob's data section, not a copy: the runtime copies each record
        # into an MLX array of its own and then drops the view (:meth:`drop_data`).
        data = memoryview(blob)[start + size :]
        inputs = read.strings(header["inputs"], "inputs")
        input_meta = [
            _input_meta(read, m, f"input_meta[{i}]")
            for i, m in enumerate(read.items(header["input_meta"], "input_meta"))
        ]
        if len(input_meta) != len(inputs):
            raise read.fail("input_meta", len(input_meta), f"expected one entry per input ({len(inputs)})")
        constants = _records(read, header["constants"], "constants", len(data))
        state = _records(read, header["state"], "state", len(data))
        defined = _unique(read, [*inputs, *constants, *state], "inputs, constants and state")
        for i, node in enumerate(read.items(header["nodes"], "nodes")):
            where = f"nodes[{i}]"
            read.record(node, where, keys=("name", "op", "args", "kwargs", "dtype"))
            read.string(node["op"], f"{where}.op")
            if node["dtype"] is not None:
                torch_dtype_at(read, node["dtype"], f"{where}.dtype")
            _check_value(read, read.items(node["args"], f"{where}.args"), defined, f"{where}.args")
            for key, value in read.record(node["kwargs"], f"{where}.kwargs").items():
                _check_value(read, value, defined, f"{where}.kwargs.{key}")
            name = read.string(node["name"], f"{where}.name")
            if name in defined:
                raise read.fail(f"{where}.name", name, "names a value defined before")
            defined.add(name)
        outputs = read.items(header["outputs"], "outputs")
        for k, output in enumerate(outputs):
            if isinstance(output, (list, str)) or (isinstance(output, dict) and "$v" not in output):
                raise read.fail(f"outputs[{k}]", output, 'an output is a reference {"$v": name} or a number')
            _check_value(read, output, defined, f"outputs[{k}]")
        updates = read.record(header["state_updates"], "state_updates")
        for key, value in updates.items():
            if key not in state:
                raise read.fail("state_updates", key, "names no state buffer")
            if read.string(value, f"state_updates[{key!r}]") not in defined:
                raise read.fail(f"state_updates[{key!r}]", value, "names no value of the program")
        in_place = []
        for i, entry in enumerate(read.items(header["in_place"], "in_place")):
            where = f"in_place[{i}]"
            read.record(entry, where, keys=("output", "input", "node"))
            in_place.append(
                InPlaceCandidate(
                    output=read.integer(entry["output"], f"{where}.output", 0, len(outputs)),
                    input=read.integer(entry["input"], f"{where}.input", 0, len(inputs)),
                    node=read.string(entry["node"], f"{where}.node"),
                )
            )
            if entry["node"] not in {n["name"] for n in header["nodes"]}:
                raise read.fail(f"{where}.node", entry["node"], "names no node of the program")
        return cls(
            inputs=inputs,
            input_meta=input_meta,
            outputs=list(outputs),
            nodes=list(header["nodes"]),
            constants=constants,
            state=state,
            state_updates=dict(updates),
            in_place=in_place,
            data=data,
        )

    def add_tensor(self, tensor: torch.Tensor) -> TensorRecord:
        """Append ``tensor``'s bytes to the data section (64-byte aligned) and describe them.

        A tensor whose every byte is zero is described as zeros and adds no bytes; one
        whose bytes are already in the data section points at them (the runtime copies
        each record into an array of its own, so sharing bytes shares no memory).
        """
        flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        if not bool(flat.any()):
            return TensorRecord(0, flat.numel(), dtype_name(tensor.dtype), tuple(tensor.shape), zeros=True)
        raw = flat.numpy().tobytes()
        digest = hashlib.sha256(raw).digest() + len(raw).to_bytes(8, "little")
        offset = self._stored.get(digest)
        if not isinstance(self.data, bytearray):
            raise TypeError("a parsed blob's data section is read-only: build a new DelegateProgram to add tensors")
        if offset is None:
            pad = (-len(self.data)) % 64
            self.data += b"\x00" * pad
            offset = len(self.data)
            self.data += raw
            self._stored[digest] = offset
        return TensorRecord(offset, len(raw), dtype_name(tensor.dtype), tuple(tensor.shape))

    def drop_data(self) -> None:
        """Forget the data section (a view of the blob after :meth:`from_bytes`) once every
        record is loaded: the runtime then frees the blob, and :meth:`array` of a record
        that is not zeros raises."""
        self.data = bytearray()

    def array(self, record: TensorRecord) -> np.ndarray:
        """A numpy view of a record's bytes (read only); a new zero array for a zeros record."""
        np_dtype = torch.empty((), dtype=torch_dtype(record.dtype)).numpy().dtype
        if record.zeros:
            return np.zeros(record.shape, dtype=np_dtype)
        flat = np.frombuffer(
            memoryview(self.data), dtype=np_dtype, count=record.nbytes // np_dtype.itemsize, offset=record.offset
        )
        return flat.reshape(record.shape)
