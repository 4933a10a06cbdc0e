"""A local Hugging Face model folder checked as data before any model is built.

:func:`check_folder` reads the folder with nothing but checked file reads, in this order,
and stops at the first problem with a :class:`FolderRefused` naming the file, the field or
the tensor, the value and what to do:

1. ``config.json`` is a regular file of at most 16 MiB (not a directory, a device, a
   symlink loop), JSON nested at most 64 deep, an object that asks for no code from the
   folder (``auto_map``: writeback never runs it).
2. Its sizes are positive integers of sane range (``vocab_size``, ``hidden_size``,
   ``num_hidden_layers``, heads, ``max_position_embeddings`` ...), the heads divide the
   hidden size (unless ``head_dim`` is given) and the KV heads divide the heads.
3. The model those sizes describe (its parameters as float32, which is how folders are
   loaded, plus the K+V cache) fits in the memory this machine has available
   (:func:`writeback_core.memory.available_memory`), the rule ``--cache-mib`` follows:
   worked out from the numbers alone, before anything is allocated.
4. The weights are safetensors (pickled weights are refused, never read), each file a
   regular file whose header is read and checked here: its length, JSON, every tensor's
   dtype, shape and byte range inside the file, exactly the bytes its shape needs, no
   two ranges overlapping.
5. Against the architecture (built on the meta device: no memory): every parameter is
   present with its shape; no tensor is unexpected; every tensor is fp32, fp16 or bf16
   (which convert to the model's float32 exactly); every value is finite.

Step 5's findings other than a wrong shape are accepted when the caller says so
(``accept_weights``; the CLI's ``--accept-weights``): they come back as notes to print.
Nothing read here becomes code, and nothing is unpickled.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from writeback_core.memory import GIB, available_memory
from writeback_core.types import ModelCase

__all__ = [
    "FolderRefused",
    "SafetensorsEntry",
    "accepted_note",
    "check_config",
    "check_folder",
    "model_nbytes",
    "read_config",
    "read_safetensors_header",
]

# config.json is a few KiB; anything past this is not a config.
_CONFIG_BYTES = 16 << 20
# Deeper than this, a JSON document is not a config (and Python's parser would recurse).
_CONFIG_DEPTH = 64
# safetensors' own bound on a header.
_HEADER_BYTES = 100 << 20
# No size field of a config exceeds this (a vocabulary of 2^31 tokens is a typo or an attack).
_MAX_FIELD = (1 << 31) - 1
# The cache a folder's model gets at most (hf_case's cap), in positions.
_CACHE_POSITIONS = 1024
# Scanned for non-finite values this many elements at a time (bounded scratch memory).
_SCAN_ELEMENTS = 1 << 22

_DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
# Every value of these is a float32 value: a float model takes them exactly.
_EXACT_FLOATS = frozenset({"F32", "F16", "BF16"})
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

ACCEPT_OPTION = "--accept-weights"


class FolderRefused(ValueError):
    """The folder cannot give a model: one paragraph naming the file, field or tensor."""


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file, as its checked header gives it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _regular_file(path: Path, what: str, limit: int | None) -> int:
    """The size of ``path`` after checking it is a regular file (followed through links) of at most ``limit``."""
    try:
        info = os.stat(path)
    except OSError as error:
        reason = error.strerror or error
        raise FolderRefused(f"{what} {path}: cannot be read ({reason}); give a regular file") from error
    if stat.S_ISDIR(info.st_mode):
        raise FolderRefused(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise FolderRefused(f"{what} {path} is not a regular file (a device, a pipe or a socket); give a regular file")
    if limit is not None and info.st_size > limit:
        raise FolderRefused(f"{what} {path} holds {info.st_size} bytes, more than the {limit} any such file needs")
    return info.st_size


def _read(path: Path, start: int, count: int) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(start)
        return handle.read(count)


def _depth(text: str) -> int:
    """How deep ``text``'s JSON nests (brackets outside strings), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _json(data: bytes, where: str) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FolderRefused(f"{where} is not UTF-8 text (byte {error.start}); it must be JSON") from error
    deepest = _depth(text)
    if deepest > _CONFIG_DEPTH:
        raise FolderRefused(f"{where} nests {deepest} levels deep, more than the {_CONFIG_DEPTH} any such file needs")
    try:
        return json.loads(text)
    except ValueError as error:
        raise FolderRefused(f"{where} is not valid JSON: {error}") from error


def read_config(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict, checked (steps 1 of :func:`check_folder`).

    :raises FolderRefused: not a regular file, too large, too deep, not a JSON object, or
        asking for code from the folder.
    """
    path = folder / "config.json"
    size = _regular_file(path, "config.json", _CONFIG_BYTES)
    config = _json(_read(path, 0, size), f"config.json {path}")
    if not isinstance(config, dict):
        raise FolderRefused(f"config.json {path} holds a JSON {type(config).__name__}, not an object of settings")
    if "auto_map" in config:
        raise FolderRefused(
            f"config.json {path} names model code shipped in the folder (auto_map: {json.dumps(config['auto_map'])}); "
            "writeback never runs code from a model folder and has no option to: use a checkpoint of an "
            "architecture transformers has built in (its model_type), converted to that architecture's layout"
        )
    return config


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def _int_field(config: Mapping[str, Any], name: str, where: str, default: int | None = None) -> int | None:
    value = config.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise FolderRefused(f"{where}: {name} is {json.dumps(value)}, not a whole number; give a positive integer")
    if not 1 <= value <= _MAX_FIELD:
        raise FolderRefused(f"{where}: {name} is {value}; it must be between 1 and {_MAX_FIELD}")
    return value


@dataclass(frozen=True)
class _Sizes:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    positions: int
    tied: bool


def check_config(config: Mapping[str, Any], where: str) -> _Sizes:
    """The sizes ``config`` gives, each checked (step 2 of :func:`check_folder`).

    :raises FolderRefused: a size that is missing where needed, not a positive integer,
        out of range, or heads that do not divide the hidden size.
    """
    text = _text_config(config)
    fields: dict[str, int | None] = {}
    for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
        fields[name] = _int_field(text, name, where)
        if fields[name] is None:
            raise FolderRefused(f"{where}: {name} is missing; a causal LM's config gives it")
    vocab, hidden, layers = (int(fields[n] or 0) for n in fields)
    # A model without attention (Mamba, Mamba2) gives no heads: its estimate has no attention
    # projections and no K+V cache (a lower bound, as for every layout other than Llama's).
    heads = _int_field(text, "num_attention_heads", where) or 0
    kv_heads = _int_field(text, "num_key_value_heads", where, heads or None) or heads
    given_dim = _int_field(text, "head_dim", where)
    intermediate = _int_field(text, "intermediate_size", where) or 0
    positions = _int_field(text, "max_position_embeddings", where)
    if heads and given_dim is None and hidden % heads:
        raise FolderRefused(
            f"{where}: num_attention_heads {heads} does not divide hidden_size {hidden}; give sizes where it does, "
            "or a head_dim"
        )
    if heads and heads % kv_heads:
        raise FolderRefused(f"{where}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return _Sizes(
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=given_dim or (hidden // heads if heads else 0),
        intermediate=intermediate,
        positions=min(positions or _CACHE_POSITIONS, _CACHE_POSITIONS),
        tied=bool(tied),
    )


def model_nbytes(sizes: _Sizes) -> tuple[int, int, int]:
    """``(parameters, weight bytes, cache bytes)`` of a decoder of ``sizes`` as float32:
    embeddings, per layer the attention projections, a gated MLP and two norms, a final
    norm and (untied) an output head; a K and a V cache per layer."""
    h, d = sizes.hidden, sizes.head_dim
    per_layer = h * sizes.heads * d * 2 + h * sizes.kv_heads * d * 2 + 3 * h * sizes.intermediate + 2 * h
    parameters = sizes.vocab * h * (1 if sizes.tied else 2) + sizes.layers * per_layer + h
    cache = sizes.layers * 2 * sizes.kv_heads * d * sizes.positions
    return parameters, parameters * 4, cache * 4


def _check_fits(sizes: _Sizes, where: str) -> None:
    parameters, weights, cache = model_nbytes(sizes)
    memory = available_memory()
    if memory is None:
        return
    limit, kind = memory
    if weights + cache > limit:
        raise FolderRefused(
            f"{where} describes a model too large to build: {parameters:,} parameters ({sizes.layers:,} layers, "
            f"hidden_size {sizes.hidden:,}, vocab_size {sizes.vocab:,}) need {weights / GIB:.1f} GiB as float32 "
            f"plus {cache / GIB:.1f} GiB of K+V cache, more than the {limit / GIB:.1f} GiB of memory this machine has "
            f"{kind}; check those sizes against the weights"
        )


def read_safetensors_header(path: Path) -> dict[str, SafetensorsEntry]:
    """The tensors of the safetensors file ``path``, from its header, each checked against the file.

    :raises FolderRefused: not a regular file; a header length, JSON, dtype, shape or byte
        range the file cannot hold; two tensors sharing bytes.
    """
    size = _regular_file(path, "weights file", None)
    if size < 8:
        raise FolderRefused(f"weights file {path} holds {size} bytes: too short for a safetensors header")
    length = int.from_bytes(_read(path, 0, 8), "little")
    if length > _HEADER_BYTES or 8 + length > size:
        raise FolderRefused(
            f"weights file {path}: its header claims {length} bytes, but the file holds {size} "
            f"(and no header exceeds {_HEADER_BYTES}); the file is cut short or not safetensors"
        )
    header = _json(_read(path, 8, length), f"weights file {path}'s header")
    if not isinstance(header, dict):
        raise FolderRefused(f"weights file {path}: its header is a JSON {type(header).__name__}, not an object")
    data_start, data_bytes = 8 + length, size - 8 - length
    entries: dict[str, SafetensorsEntry] = {}
    for name, record in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, record, data_start, data_bytes)
    ranges = sorted((e.start, e.end, n) for n, e in entries.items() if e.end > e.start)
    for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
        if start < end:
            raise FolderRefused(f"weights file {path}: tensors {first!r} and {second!r} share bytes; the header lies")
    return entries


def _entry(path: Path, name: str, record: Any, data_start: int, data_bytes: int) -> SafetensorsEntry:
    where = f"weights file {path}: tensor {name!r}"
    if not isinstance(record, dict):
        raise FolderRefused(f"{where} has no dtype/shape/data_offsets record")
    dtype, shape, offsets = record.get("dtype"), record.get("shape"), record.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise FolderRefused(f"{where} has dtype {json.dumps(dtype)}; safetensors dtypes: {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise FolderRefused(f"{where} has shape {json.dumps(shape)}; a shape is a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise FolderRefused(
            f"{where} has data_offsets {json.dumps(offsets)}, outside the {data_bytes} bytes of data the file holds; "
            "the file is cut short or its header lies"
        )
    needed = math.prod(shape) * _DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != needed:
        raise FolderRefused(
            f"{where} of shape {shape} and dtype {dtype} needs {needed} bytes, but its data_offsets give "
            f"{offsets[1] - offsets[0]}; the header lies"
        )
    return SafetensorsEntry(path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        size = _regular_file(index, "weights index", _CONFIG_BYTES)
        mapping = _json(_read(index, 0, size), f"weights index {index}")
        weight_map = mapping.get("weight_map") if isinstance(mapping, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise FolderRefused(f"weights index {index} has no weight_map of tensor names to file names")
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise FolderRefused(f"weights index {index} names {name!r}: only .safetensors files in the folder")
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    if os.path.lexists(single):
        return [single]
    pickled = sorted(p.name for pattern in _PICKLED for p in folder.glob(pattern))
    if pickled:
        raise FolderRefused(
            f"model folder {folder} holds its weights only as pickle files ({', '.join(pickled)}), which writeback "
            "never loads (unpickling runs code); convert them to model.safetensors with the tool that wrote them"
        )
    raise FolderRefused(f"model folder {folder} has no model.safetensors (or model.safetensors.index.json)")


def _expected(
    config_path: Path, accept_remote: bool = False
) -> tuple[dict[str, tuple[int, ...]], list[list[frozenset[str]]]]:
    """Every tensor name a folder of the architecture may hold, with its shape, and per parameter
    (the names that share it: a tied embedding and head) the sets of names that each give it
    whole, built on the meta device.

    A parameter transformers stores in another form than it computes with (the experts of a
    mixture-of-experts layer, one tensor per expert in a folder, stacked in the model) is given
    either way: by its own name, or by every name transformers' conversion saves it as
    (``revert_weight_conversion``, which ``save_pretrained`` applies and ``from_pretrained`` undoes).
    """
    from transformers.core_model_loading import revert_weight_conversion

    from writeback_decoders.hf import config_of, require_transformers

    transformers = require_transformers("a Hugging Face model folder")
    try:
        config = config_of(config_path.parent)
    except (ValueError, OSError, KeyError, TypeError) as error:
        raise FolderRefused(
            f"config.json {config_path}: transformers cannot read it ({str(error).splitlines()[0]}); "
            "writeback reads folders of the architectures transformers has built in, and never runs code from a folder"
        ) from error
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict(keep_vars=True)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    forms: dict[str, list[frozenset[str]]] = {}
    for name, tensor in state.items():
        saved = revert_weight_conversion(model, {name: tensor})
        forms[name] = [frozenset([name])] if set(saved) == {name} else [frozenset([name]), frozenset(saved)]
        shapes.update((key, tuple(value.shape)) for key, value in saved.items())
    by_tensor: dict[int, list[frozenset[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).extend(forms[name])
    return shapes, list(by_tensor.values())


def _nonfinite(entry: SafetensorsEntry) -> tuple[int, float] | None:
    """The first non-finite value of a float tensor (its index and value), or ``None``.

    Read a chunk at a time into one buffer (not mapped): the check holds a few MiB however
    large the weights, and leaves no file pages counted in the process's resident memory.
    """
    dtype = _DTYPES[entry.dtype]
    count = (entry.end - entry.start) // dtype.itemsize
    buffer = bytearray(min(count, _SCAN_ELEMENTS) * dtype.itemsize)
    with open(entry.file, "rb", buffering=0) as handle:
        for first in range(0, count, _SCAN_ELEMENTS):
            n = min(_SCAN_ELEMENTS, count - first)
            view = memoryview(buffer)[: n * dtype.itemsize]
            handle.seek(entry.start + first * dtype.itemsize)
            if handle.readinto(view) != len(view):
                raise FolderRefused(f"weights file {entry.file} ended while its tensors were read; it is cut short")
            chunk = torch.frombuffer(view, dtype=dtype, count=n)
            bad = (~torch.isfinite(chunk)).nonzero()
            if bad.numel():
                index = int(bad[0, 0])
                return first + index, float(chunk[index])
    return None


def _weight_findings(
    entries: Mapping[str, SafetensorsEntry],
    shapes: Mapping[str, tuple[int, ...]],
    shared: list[list[frozenset[str]]],
) -> Iterator[tuple[str, bool]]:
    """Each problem of the weights against the architecture, with whether ``accept_weights`` may pass it."""
    for name, entry in sorted(entries.items()):
        if name not in shapes:
            yield f"tensor {name!r} in {entry.file.name} is not a parameter of this architecture (unexpected)", True
        elif entry.shape != shapes[name]:
            yield (
                (
                    f"tensor {name!r} in {entry.file.name} has shape {list(entry.shape)}, but the config's "
                    f"architecture needs {list(shapes[name])}; the weights are for other sizes than config.json gives"
                ),
                False,
            )
    for forms in shared:
        if not any(form <= entries.keys() for form in forms):
            first = min(min(form) for form in forms if len(form) == 1)
            yield f"parameter {first!r} is missing from the weights (it would be left random)", True
    for name, entry in sorted(entries.items()):
        if name in shapes and entry.dtype not in _EXACT_FLOATS:
            yield (
                (
                    f"tensor {name!r} in {entry.file.name} is {entry.dtype}, which does not convert exactly to the "
                    "model's float32 (fp32, fp16 and bf16 do)"
                ),
                True,
            )
        elif entry.dtype in _EXACT_FLOATS:
            found = _nonfinite(entry)
            if found is not None:
                yield f"tensor {name!r} in {entry.file.name} holds {found[1]} at flat index {found[0]}", True


def check_folder(folder: str | os.PathLike[str], accept_weights: bool = False) -> list[str]:
    """Check the model folder ``folder`` as the module docstring says, before any model is built.

    :param accept_weights: pass missing, unexpected, non-float and non-finite tensors
        (the CLI's ``--accept-weights``) instead of refusing them.
    :return: what was accepted, one line each (empty when the weights match the model).
    :raises FolderRefused: the first problem found, in one paragraph.
    """
    path = Path(folder)
    config = read_config(path)
    where = f"config.json {path / 'config.json'}"
    sizes = check_config(config, where)
    _check_fits(sizes, where)
    entries: dict[str, SafetensorsEntry] = {}
    for file in _weight_files(path):
        for name, entry in read_safetensors_header(file).items():
            if name in entries:
                raise FolderRefused(f"tensor {name!r} is in both {entries[name].file.name} and {file.name}")
            entries[name] = entry
    shapes, shared = _expected(path / "config.json")
    accepted: list[str] = []
    for problem, acceptable in _weight_findings(entries, shapes, shared):
        if not acceptable:
            raise FolderRefused(f"model folder {path}: {problem}")
        if not accept_weights:
            raise FolderRefused(
                f"model folder {path}: {problem}; the model would not compute what its weights say. Fix the weights, "
                f"or pass {ACCEPT_OPTION} to load them as they are"
            )
        accepted.append(problem)
    return accepted


def accepted_note(case: ModelCase, accepted: list[str], shown: int = 3) -> ModelCase:
    """``case`` with what ``--accept-weights`` let through (the first ``shown`` problems) in its
    description, and in the description of every case derived from it (its dynamic-prefill
    and quantized forms), so that every command's output says it."""
    more = f"; and {len(accepted) - shown} more" if len(accepted) > shown else ""
    note = f"{ACCEPT_OPTION} accepted weights that do not match the model: " + "; ".join(accepted[:shown]) + more
    return _noted(case, note)


def _noted(case: ModelCase, note: str) -> ModelCase:
    prefill, quantized = case.dynamic_prefill, case.quantized
    return replace(
        case,
        description=f"{case.description}; {note}",
        dynamic_prefill=None if prefill is None else lambda: _noted(prefill(), note),
        quantized=None if quantized is None else lambda name: _noted(quantized(name), note),
    )
