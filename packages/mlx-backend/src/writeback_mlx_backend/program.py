"""The processed blob of the MLX delegate: a JSON graph followed by raw tensor bytes.

Layout: ``MAGIC`` (8 bytes), the JSON header's length (little-endian u64), the
header (UTF-8 JSON), then the data section. Tensors in the header name their
``offset`` and ``nbytes`` in the data section, their ``dtype`` (a torch dtype
name) and ``shape``. Node arguments are JSON values where ``{"$v": name}``
refers to another value and ``{"$dtype": name}`` to a dtype. No pickle: the blob
loads in any process that has this package and MLX.

``VERSION`` is bumped whenever the meaning of a field changes; a runtime
refuses a blob whose version it does not know.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["MAGIC", "VERSION", "DelegateProgram", "InPlaceCandidate", "TensorRecord"]

MAGIC = b"WBMLX\x00\x00\x01"
VERSION = 1

_TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name``; raises naming the known ones otherwise."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} in an MLX delegate blob is not one of {sorted(_TORCH_DTYPES)}") from None


@dataclass(frozen=True)
class TensorRecord:
    """Where a constant or initial state lives in the data section."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> TensorRecord:
        return cls(
            int(record["offset"]), int(record["nbytes"]), str(record["dtype"]), tuple(int(s) for s in record["shape"])
        )


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
    data: bytearray = field(default_factory=bytearray)

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
        """Serialize as ``MAGIC | len | JSON | data``."""
        text = json.dumps(self.header(), separators=(",", ":")).encode()
        return MAGIC + struct.pack("<Q", len(text)) + text + bytes(self.data)

    @classmethod
    def from_bytes(cls, blob: bytes) -> DelegateProgram:
        """Parse a blob made by :meth:`to_bytes`; raises ``ValueError`` on any other bytes."""
        if blob[: len(MAGIC)] != MAGIC:
            raise ValueError(
                "not an MLX delegate blob made by writeback-mlx-backend (bad magic "
                f"{bytes(blob[:8])!r}); was it lowered by another backend?"
            )
        (size,) = struct.unpack_from("<Q", blob, len(MAGIC))
        start = len(MAGIC) + 8
        header = json.loads(bytes(blob[start : start + size]))
        if header.get("version") != VERSION:
            raise ValueError(
                f"MLX delegate blob has version {header.get('version')}, this runtime reads "
                f"version {VERSION}; lower the model again with this writeback-mlx-backend"
            )
        return cls(
            inputs=list(header["inputs"]),
            input_meta=list(header["input_meta"]),
            outputs=list(header["outputs"]),
            nodes=list(header["nodes"]),
            constants={k: TensorRecord.from_json(v) for k, v in header["constants"].items()},
            state={k: TensorRecord.from_json(v) for k, v in header["state"].items()},
            state_updates=dict(header["state_updates"]),
            in_place=[InPlaceCandidate(**c) for c in header["in_place"]],
            data=bytearray(blob[start + size :]),
        )

    def add_tensor(self, tensor: torch.Tensor) -> TensorRecord:
        """Append ``tensor``'s bytes to the data section (64-byte aligned) and describe them."""
        pad = (-len(self.data)) % 64
        raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        record = TensorRecord(len(self.data) + pad, len(raw), dtype_name(tensor.dtype), tuple(tensor.shape))
        self.data += b"\x00" * pad
        self.data += raw
        return record

    def array(self, record: TensorRecord) -> np.ndarray:
        """A numpy view of a record's bytes (read only)."""
        np_dtype = torch.empty((), dtype=torch_dtype(record.dtype)).numpy().dtype
        flat = np.frombuffer(
            memoryview(self.data), dtype=np_dtype, count=record.nbytes // np_dtype.itemsize, offset=record.offset
        )
        return flat.reshape(record.shape)
