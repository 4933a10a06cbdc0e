"""Bytes a program constant and a delegate's named data share, stored once in a single ``.pte``.

A tied embedding and LM head is one matrix read twice: by the lookup, as a program constant
(exir's constant segment), and by a delegate's linear layer, as named data (a segment of its
own per key). exir writes both, so a single ``.pte`` holds the matrix twice. ExecuTorch's
runtime reads a named-data key through the program's segment table, an offset and a size
from the start of the segment data, and reads constants through the constant segment's table;
nothing asks the segments to be apart. :func:`store_named_data_once` serializes the program
without the named data whose bytes equal a constant's, then points each such key at that
constant's bytes inside the constant segment: the file holds them once, and the stock runtime
and ``TextLLMRunner`` load it unchanged (the delegate gets the same bytes under the same key).

The other way round is closed in ExecuTorch 1.5: a constant exir marks external (its
``TensorDataLocation.EXTERNAL``) is looked up only in the data map given to the method's load
(a ``.ptd``); the program's own named data is handed to delegates alone, so a lookup table
stored as named data would not load from a single file.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executorch.exir import ExecutorchBackendConfig, ExecutorchProgramManager

__all__ = ["StoredOnce", "store_named_data_once", "stored_once"]

# What each program manager had stored once, for the commands that report it.
_RECORDS: weakref.WeakKeyDictionary[Any, tuple[StoredOnce, ...]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class StoredOnce:
    """A delegate's named data read from a program constant's bytes instead of its own segment."""

    #: The delegate's named-data key.
    key: str
    #: The constant's dtype and shape as the program declares them (``"int8 [8192, 64]"``).
    tensor: str
    nbytes: int


def _digest(data: Any) -> bytes:
    """sha256 of a named-data buffer (bytes, or exir's file-backed data) or a constant's bytes."""
    return data.sha256() if hasattr(data, "sha256") else hashlib.sha256(data).digest()


def _constant_tensors(program: Any) -> dict[int, str]:
    """Constant-buffer index -> ``"dtype [shape]"`` of a tensor of the emitted program that reads it."""
    from executorch.exir.schema import Tensor
    from executorch.exir.tensor import get_scalar_type

    found: dict[int, str] = {}
    for plan in program.execution_plan:
        for value in plan.values:
            tensor = value.val
            if isinstance(tensor, Tensor) and tensor.data_buffer_idx > 0 and tensor.allocation_info is None:
                dtype = str(get_scalar_type(tensor.scalar_type)).removeprefix("torch.")
                found.setdefault(tensor.data_buffer_idx, f"{dtype} {list(tensor.sizes)}")
    return found


def _shared(program: ExecutorchProgramManager, alignment: int) -> dict[str, tuple[int, StoredOnce]]:
    """Named-data key -> (constant index, record) for every key whose bytes a constant holds at
    an offset its alignment allows (the constant segment aligns each constant to ``alignment``)."""
    named = program._named_data
    if named is None or not named.pte_data:
        return {}
    constants = program._emitter_output.program.constant_buffer
    by_size: dict[int, list[int]] = {}
    for index, buffer in enumerate(constants):
        if len(buffer.storage):
            by_size.setdefault(len(buffer.storage), []).append(index)
    digests: dict[int, bytes] = {}
    tensors = _constant_tensors(program._emitter_output.program)
    found: dict[str, tuple[int, StoredOnce]] = {}
    for key, entry in named.pte_data.items():
        data = named.buffers[entry.buffer_index]
        candidates = by_size.get(len(data), [])
        if not candidates or alignment % entry.alignment:
            continue
        digest = _digest(data)
        for index in candidates:
            if index not in digests:
                digests[index] = _digest(constants[index].storage)
            if digests[index] == digest:
                record = StoredOnce(key, tensors.get(index, f"constant {index}"), len(data))
                found[key] = (index, record)
                break
    return found


def store_named_data_once(program: ExecutorchProgramManager, config: ExecutorchBackendConfig) -> tuple[StoredOnce, ...]:
    """Re-serialize ``program`` (made by ``to_executorch(config)``) so that each delegate's
    named data whose bytes equal a program constant's is read from that constant's place in
    the constant segment, not stored a second time. Returns what is now stored once (empty:
    nothing shared, ``program`` unchanged).

    Steps: 1. match named data to constants by size and sha256 (a key is taken only if the
    constant's offset in the segment meets the key's alignment); 2. serialize the program with
    those keys left out; 3. add each key back to the program's named data with a segment entry
    of its own whose offset and size are the constant's bytes inside the constant segment;
    4. encode the program table and its header again before the unchanged segment data.

    A program whose weights go to a data file (``external_constants``) is left as it is: there
    ExecuTorch's data store already keeps equal bytes once.
    """
    from executorch.exir._serialize._flatbuffer_program import _flatbuffer_to_program, _program_to_flatbuffer
    from executorch.exir._serialize._named_data_store import NamedDataStoreOutput
    from executorch.exir._serialize._program import (
        _ExtendedHeader,
        _get_extended_header,
        _insert_flatbuffer_header,
    )
    from executorch.exir._serialize._serialize import serialize_for_executorch
    from executorch.exir._serialize.padding import aligned_size, pad_to
    from executorch.exir.schema import DataSegment, NamedData
    from executorch.exir.tensor import ALIGNMENT

    if program._tensor_data or program._emitter_output.external_constant_map:
        return ()
    alignment = config.constant_tensor_alignment or ALIGNMENT
    shared = _shared(program, alignment)
    if not shared:
        return ()
    named = program._named_data
    assert named is not None  # _shared found keys in it
    kept = {key: entry for key, entry in named.pte_data.items() if key not in shared}
    pte, _ = serialize_for_executorch(
        program._emitter_output,
        config,
        program._data_serializer,
        NamedDataStoreOutput(buffers=named.buffers, pte_data=kept, external_data={}),
    )
    pieces = list(pte._buffers)
    head = pieces[0]
    header = _get_extended_header(head)
    if not isinstance(head, bytes) or header is None or len(head) != header.program_size:
        raise RuntimeError("exir's serialized program does not start with its flatbuffer and extended header")
    if len(pieces) < 2 or len(pieces[1]) != header.segment_base_offset - header.program_size:
        raise RuntimeError("exir's serialized program does not pad its flatbuffer to the segment data")
    segment_data = pieces[2:]

    table = _flatbuffer_to_program(head)
    constant_segment = table.segments[table.constant_segment.segment_index]
    table.named_data = list(table.named_data or [])  # None when every key was shared
    for key, (index, record) in shared.items():
        offset = constant_segment.offset + table.constant_segment.offsets[index]
        table.named_data.append(NamedData(key=key, segment_index=len(table.segments)))
        table.segments.append(DataSegment(offset=offset, size=record.nbytes))
    encoded = _program_to_flatbuffer(
        table,
        constant_tensor_alignment=config.constant_tensor_alignment,
        delegate_alignment=config.delegate_alignment,
    )
    header_length = aligned_size(_ExtendedHeader.EXPECTED_LENGTH, encoded.max_alignment)
    program_size = header_length + len(encoded.data)
    base = aligned_size(program_size, config.segment_alignment)
    new_header = _ExtendedHeader(
        program_size=program_size, segment_base_offset=base, segment_data_size=header.segment_data_size
    )
    flat = _insert_flatbuffer_header(
        flatbuffer_data=encoded.data,
        magic_regex=r"ET[0-9a-zA-Z][0-9a-zA-Z]",
        header_data=pad_to(new_header.to_bytes(), header_length),
    )
    pte._buffers = [flat, b"\x00" * (base - program_size), *segment_data]
    pte._byte_size = base + header.segment_data_size
    program._pte_data = pte
    program._buffer = None
    records = tuple(record for _, record in shared.values())
    _RECORDS[program] = records
    return records


def stored_once(program: ExecutorchProgramManager) -> tuple[StoredOnce, ...]:
    """What :func:`store_named_data_once` stored once in ``program`` (empty: nothing, or not called)."""
    return _RECORDS.get(program, ())
