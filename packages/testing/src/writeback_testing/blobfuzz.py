"""Structure-aware fuzzing of delegate blobs and ``.pte`` execution plans: no field of a file
may crash the process.

A ``.pte`` is untrusted input, and so is every delegate blob in it. This fuzzer
starts from real ones and changes one field at a time:

1. **Seeds.** Small real programs (:data:`SEED_PROGRAMS`: a decoder step's cache
   write, a mix of embedding, cat, where, cumsum and matmul) are exported and
   lowered through writeback's one lowering path, for every backend and every
   aliasing engine the registry offers (MLX, the kv-alias copy-back engine, a
   third party's backend: whatever plugins are loaded), and to a plain ``.pte``.
   For each delegate call of the lowered edge program, the seed keeps its blob,
   its compile specs, the tensors the call receives and eager PyTorch's answer
   (exir runs the partition's own graph eagerly). A ``.pte`` seed keeps the
   program, its inputs and eager's outputs of the module.
2. **Mutants.** Mutant ``i`` of a target is drawn from ``Random(f"{seed}:{target}:{i}")``
   alone, so any one can be made again. A JSON blob (or the zlib-compressed JSON
   header of a ``MAGIC | length | zlib(JSON) | data`` blob) is decoded and one
   field is changed: an int to a boundary (-1, 0, the value +-1, 2**31, 2**63,
   a 5,000-digit integer...), a string to another name of the same blob (a
   reference to another entry), a list shortened, lengthened, reordered or
   emptied, an object's key dropped or added, any value to another JSON type;
   or the bytes are truncated, flipped or the length field changed. A ``.pte``
   has one scalar of its execution plan changed in place
   (:func:`writeback_testing.ptefields.plan_fields`: value kinds, dims, sizes,
   dim orders, dtypes, memory offsets, operator and value indices...). Some
   mutants only re-encode the same JSON: they must give eager's answer.
3. **Oracle.** Each mutant runs the real path (the delegate's ``init``,
   ``execute``, ``destroy``; the runtime's ``load_program``, ``load_method`` and a
   call) and its outcome is one of: ``refused`` (a clean error: ``BlobError``,
   or a ``ValueError``/``IndexError``/``TypeError``/``RuntimeError`` that the code
   raised on purpose or a kernel raised, as eager would); ``ran`` (a changed
   program ran); ``equal`` (an unchanged program gave eager's answer). Findings:
   ``wrong`` (an unchanged program's answer differs from eager's), ``escaped``
   (any other exception type, Python's own messages such as ``list index out of
   range`` or ``invalid literal for int()``, or an MLX error surfacing as is),
   ``crash`` (the process died: signal, abort) and ``hang``.
4. **Workers.** Mutants run in a worker process that runs a range of mutants,
   printing each mutant's index and path before running it; when it dies the
   parent records the crash with that mutant's reproduction and starts a new
   worker after it. Workers are forked by a fork server (``python -m
   writeback_testing.blobfuzz serve``, one per set of plugins and environment,
   living as long as the process that started it), which imports torch and exir
   and builds each target's seeds once: a new worker, after a crash or for the
   next run, costs a fork, not a fresh interpreter and a lowering.
   (``python -m writeback_testing.blobfuzz worker`` runs a range in a process
   of its own.)

Reproduce one mutant in the current process:
``python -m writeback_testing.blobfuzz repro --target TARGET --seed S --index I``.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import json
import linecache
import math
import os
import random
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_PLUGINS",
    "BlobFuzzReport",
    "Finding",
    "Outcome",
    "Seed",
    "build_seeds",
    "classify_error",
    "installed_plugins",
    "make_mutant",
    "run_blob_fuzz",
    "run_mutant",
    "seeds_of",
]

# The plugins whose backends, engines and runtime the fuzzer reaches (by module name,
# so a sibling plugin in progress does not change what CI fuzzes).
DEFAULT_PLUGINS = (
    "writeback_passes.plugin",
    "writeback_pybind_runtime.plugin",
    "writeback_trt_copyback.plugin",
    "writeback_mlx_backend.plugin",
    "writeback_example_backend.plugin",
)


def installed_plugins() -> tuple[str, ...]:
    """The modules of :data:`DEFAULT_PLUGINS` that are installed (a package may be absent)."""
    import importlib.util

    def found(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its package is not installed
            return False

    return tuple(m for m in DEFAULT_PLUGINS if found(m))


# Messages Python itself gives for a failed index, lookup, parse or unpack: an
# internal error of the code that read the blob, never a clean refusal.
_PYTHON_MESSAGES = (
    "list index out of range",
    "tuple index out of range",
    "string index out of range",
    "invalid literal for int()",
    "Exceeds the limit",
    "values to unpack",
    "unhashable type",
    "object is not subscriptable",
    "object is not iterable",
    "object is not callable",
    "unsupported operand type",
    "positional argument",
    "'NoneType'",
    "has no attribute",
    "can't multiply sequence",
    "is not in list",
    "must be str, not",
    "must be real number",
    "not supported between instances",
    "can only concatenate",
    "object cannot be interpreted as an integer",
    "Overflow when unpacking",
    "argument must be",
    "too large to convert",
)
# Set to a mutant index, makes the worker abort there (tests the crash handling).
ABORT_AT_ENV = "WRITEBACK_BLOBFUZZ_ABORT_AT"
_CLEAN_TYPES = (ValueError, IndexError, TypeError, RuntimeError, NotImplementedError)
_FINDINGS = ("wrong", "escaped", "crash", "hang")


@dataclass
class Outcome:
    """What one mutant did: ``kind`` (``refused``, ``ran``, ``equal``, or a finding:
    ``wrong``, ``escaped``, ``crash``, ``hang``) and a one-line ``detail``."""

    kind: str
    detail: str = ""


@dataclass
class Finding:
    """A mutant whose outcome is a finding, with all it takes to make it again."""

    target: str
    seed: int
    index: int
    path: str
    outcome: Outcome

    def reproduction(self) -> str:
        return (
            f"python -m writeback_testing.blobfuzz repro --target {self.target} --seed {self.seed} --index {self.index}"
        )

    def __str__(self) -> str:
        return (
            f"{self.outcome.kind} in {self.target} mutant {self.index} (seed {self.seed}): {self.path}\n"
            f"  {self.outcome.detail}\n  reproduce: {self.reproduction()}"
        )


@dataclass
class BlobFuzzReport:
    """Counts of outcomes per target, every finding, and the time taken."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    restarts: int = 0

    @property
    def mutants(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    def summary(self) -> str:
        lines = [
            f"{self.mutants} blob mutants in {self.seconds:.1f} s "
            f"({self.mutants / max(self.seconds, 1e-9):.0f}/s), {len(self.findings)} findings, "
            f"{self.restarts} worker restarts"
        ]
        for target, counts in sorted(self.counts.items()):
            lines.append(f"  {target}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        lines.extend(str(f) for f in self.findings)
        return "\n".join(lines)


# --- seeds ------------------------------------------------------------------------------------


def _seed_programs() -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Small real programs with state, and example inputs (fixed weights: seeds repeat)."""
    import torch

    class CacheWrite(torch.nn.Module):
        """A decoder step's state write: new rows into a cache at a position, then reads of it."""

        cache: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, 2, 8, 4))
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, pos: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.cache.index_copy_(2, pos, self.proj(x))
            return torch.softmax(self.cache.sum(-1), -1), self.cache[:, :, :4].transpose(1, 2).reshape(1, 4, 8)

    class Mixed(torch.nn.Module):
        """Embedding, cat, slice, where, cumsum, flip and matmul around a running state."""

        state: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(6, 4)
            self.register_buffer("state", torch.zeros(3, 4))

        def forward(self, tok: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.cat([self.emb(tok), x], 0)[1:4] * 2
            self.state.copy_(torch.where(h > 0, h, self.state) + self.state.cumsum(0))
            return h @ self.state.t(), self.state.flip(0)

    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cache_write, mixed = CacheWrite().eval(), Mixed().eval()
    return {
        "cache-write": (cache_write, (torch.tensor([5]), torch.randn(1, 2, 1, 4, generator=generator))),
        "mixed": (mixed, (torch.tensor([1, 4, 2]), torch.randn(3, 4, generator=generator))),
    }


SEED_PROGRAMS = ("cache-write", "mixed")


@dataclass
class Seed:
    """A real blob (or ``.pte``) with the call it was made for.

    ``args`` are what the delegate's ``execute`` receives (its inputs, then its
    outputs, filled with a sentinel so an unwritten one shows); ``expected`` is
    eager's answer, one tensor per output. For the ``pte`` target ``blob`` is the
    program and ``args`` the method's inputs.
    """

    target: str
    program: str
    blob: bytes
    specs: dict[str, bytes]
    args: list[Any]
    num_inputs: int
    expected: list[Any]
    backend_id: str = ""


def _export(module: Any, args: tuple[Any, ...]) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args, strict=False)


def _state_values(program: Any, user_inputs: Sequence[Any]) -> list[Any]:
    """The placeholder values of an edge program: its parameters, buffers and constants
    (cloned), then ``user_inputs``, in the signature's order."""
    from torch.export.graph_signature import InputKind

    user = iter(user_inputs)
    values: list[Any] = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            values.append(next(user))
        elif spec.target in program.state_dict:
            values.append(program.state_dict[spec.target].clone())
        else:
            values.append(program.constants[spec.target].clone())
    return values


def _delegate_seeds(target: str, name: str, edge_program: Any, inputs: Sequence[Any]) -> list[Seed]:
    """One seed per delegate call of ``edge_program``: its blob and specs, the values it
    receives and eager's answer, recorded while exir runs the program eagerly."""
    import torch
    from executorch.exir.delegate import executorch_call_delegate

    seeds: list[Seed] = []

    class _Recorder(torch.fx.Interpreter):
        def call_function(self, target_fn: Any, args: Any, kwargs: Any) -> Any:
            result = super().call_function(target_fn, args, kwargs)
            if target_fn is executorch_call_delegate:
                lowered = args[0]
                outputs = list(result) if isinstance(result, (tuple, list)) else [result]
                received = [a.clone() if isinstance(a, torch.Tensor) else a for a in args[1:]]
                sentinels = [torch.full_like(o, -7) for o in outputs]
                seeds.append(
                    Seed(
                        target=target,
                        program=f"{name}#{len(seeds)}",
                        blob=bytes(lowered.processed_bytes),
                        specs={s.key: bytes(s.value) for s in lowered.compile_specs},
                        args=[*received, *sentinels],
                        num_inputs=len(received),
                        expected=[o.clone() for o in outputs],
                        backend_id=str(lowered.backend_id),
                    )
                )
            return result

    with torch.no_grad():
        _Recorder(edge_program.graph_module).run(*_state_values(edge_program, inputs))
    return seeds


def build_seeds(registry: Any, target: str) -> list[Seed]:
    """The seeds of ``target``: ``pte``, ``backend:NAME`` or ``engine:NAME`` of ``registry``.

    :raises ValueError: the registry offers no such backend or engine.
    """
    import torch
    from writeback.lowering import lower, partition
    from writeback_core.quiet import known_warnings_ignored

    seeds: list[Seed] = []
    kind, _, name = target.partition(":")
    for program_name, (module, inputs) in _seed_programs().items():
        exported = _export(module, inputs)
        with known_warnings_ignored():
            if kind == "pte":
                lowered = lower(exported, registry, None)
                state = copy.deepcopy(module)
                with torch.no_grad():
                    expected = state(*[i.clone() for i in inputs])
                outs = list(expected) if isinstance(expected, tuple) else [expected]
                seeds.append(Seed(target, program_name, lowered.pte, {}, list(inputs), len(inputs), outs))
            elif kind == "backend":
                backends = registry.backends()
                if name not in backends:
                    raise ValueError(f"no backend {name!r} in the registry; it has {sorted(backends)}")
                edge = partition(exported, registry, backends[name]).edge
                seeds.extend(_delegate_seeds(target, program_name, edge.exported_program(), inputs))
            elif kind == "engine":
                engines = registry.engines()
                if name not in engines:
                    raise ValueError(f"no engine {name!r} in the registry; it has {sorted(engines)}")
                edge = registry.hook.writeback_lower_for_engine(engine=engines[name], program=exported)
                if not isinstance(edge, str) and edge is not None:
                    seeds.extend(_delegate_seeds(target, program_name, edge.exported_program(), inputs))
            else:
                raise ValueError(f"unknown target {target!r}: expected pte, backend:NAME or engine:NAME")
    return seeds


# Seeds built in this process, by (plugins, target): see seeds_of.
_SEEDS: dict[tuple[tuple[str, ...], str], list[Seed]] = {}


def seeds_of(target: str, plugins: Sequence[str] = DEFAULT_PLUGINS) -> list[Seed]:
    """:func:`build_seeds` of ``target`` with a registry of ``plugins``, built once per process
    (seeds are deterministic: fixed weights and inputs); each call returns its own copy.

    :raises ValueError: as :func:`build_seeds`.
    """
    key = (tuple(plugins), target)
    if key not in _SEEDS:
        _SEEDS[key] = build_seeds(_registry(plugins), target)
    return copy.deepcopy(_SEEDS[key])


def targets_of(registry: Any) -> list[str]:
    """Every target ``registry`` offers: ``pte`` (when it offers a runtime), each backend
    with a Python runtime delegate (a compiled one, such as XNNPACK, has no blob reader
    here to fuzz), each aliasing engine."""
    found = ["pte"] if registry.runtimes() else []
    delegates = registry.runtime_delegates()
    found += [f"backend:{n}" for n, b in sorted(registry.backends().items()) if b.backend_id in delegates]
    found += [f"engine:{n}" for n in sorted(registry.engines())]
    return found


# --- mutation ----------------------------------------------------------------------------------


# Stands for a 5,000-digit integer in a tree (Python's json will not write one): replaced
# by its digits when the tree is encoded.
_HUGE = "\x00a 5000-digit integer\x00"


def _int_choices(value: int) -> list[Any]:
    small = [-1, 0, 1, value + 1, value - 1, -value, -value - 1]
    return [*small, 2**31 - 1, 2**31, 2**32 + value, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30, _HUGE]


def _strings(tree: Any) -> list[str]:
    """Every string of ``tree``, keys included: other names a field could refer to."""
    found: list[str] = []
    stack = [tree]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            found.extend(value)
            stack.extend(value.values())
    return sorted(set(found)) or ["x"]


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _paths(inner, (*path, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from _paths(inner, (*path, index))


def _show_path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path) or "(root)"


def _short(value: Any) -> str:
    text = "<a 5000-digit integer>" if value == _HUGE else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _mutate_value(value: Any, rng: random.Random, names: list[str]) -> tuple[str, Any]:
    """A changed ``value``: ``(what was done, new value)``."""
    confusion: list[Any] = [
        None,
        True,
        0,
        -1,
        "0",
        "",
        [],
        {},
        [value],
        {"$ref": rng.choice(names)},
        {"$v": rng.choice(names)},
    ]
    if rng.random() < 0.25:
        new = rng.choice(confusion)
        return f"= {_short(new)} (type)", new
    if isinstance(value, bool):
        return f"= {not value}", not value
    if isinstance(value, int):
        new = rng.choice(_int_choices(value))
        return f"= {_short(new)}", new
    if isinstance(value, float):
        number = rng.choice([math.inf, -math.inf, math.nan, -0.0, 1e308, -1.0, 0.0, 2.0**63])
        return f"= {number}", number
    if isinstance(value, str):
        new = rng.choice([*names, "", value + "_", value[:-1], "__class__", "x" * 1000, "aten.add.Tensor"])
        return f"= {_short(new)} (name)", new
    if isinstance(value, list):
        return _mutate_list(value, rng)
    if isinstance(value, dict):
        return _mutate_dict(value, rng)
    return "= null", None


def _mutate_list(value: list[Any], rng: random.Random) -> tuple[str, Any]:
    new = list(value)
    op = rng.choice(["drop", "duplicate", "swap", "clear", "reverse", "append", "nest"])
    if op == "drop" and new:
        del new[rng.randrange(len(new))]
    elif op == "duplicate" and new:
        k = rng.randrange(len(new))
        new.insert(k, copy.deepcopy(new[k]))
    elif op == "swap" and len(new) > 1:
        a, b = rng.sample(range(len(new)), 2)
        new[a], new[b] = new[b], new[a]
    elif op == "clear":
        new = []
    elif op == "reverse":
        new.reverse()
    elif op == "append":
        new.append(copy.deepcopy(rng.choice(new)) if new else 0)
    else:
        new = [new]
    return f"list {op}", new


def _mutate_dict(value: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    new = dict(value)
    keys = list(new)
    op = rng.choice(["drop", "add", "rename"]) if keys else "add"
    if op == "drop":
        key = rng.choice(keys)
        del new[key]
        return f"drop key {key!r}", new
    if op == "rename":
        key = rng.choice(keys)
        new[key + "_"] = new.pop(key)
        return f"rename key {key!r}", new
    new["extra"] = 1
    return "add key 'extra'", new


def _set(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    changed = copy.deepcopy(tree)
    holder = changed
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return changed


@dataclass
class _Codec:
    """How a blob's structure is read and written back: JSON, or ``MAGIC | u64 length |
    zlib(JSON) | data`` (the MLX delegate's layout) found by its shape, not by name."""

    prefix: bytes  # the magic, for the zlib layout; empty for plain JSON
    tree: Any
    data: bytes  # what follows the compressed header

    def encode(self, tree: Any, **dumps: Any) -> bytes:
        text = json.dumps(tree, **dumps).replace(json.dumps(_HUGE), "9" * 5000).encode()
        if not self.prefix:
            return text
        packed = zlib.compress(text)
        return self.prefix + struct.pack("<Q", len(packed)) + packed + self.data


def _codec(blob: bytes) -> _Codec | None:
    try:
        return _Codec(b"", json.loads(blob), b"")
    except ValueError:
        pass
    for start in range(1, 17):
        if len(blob) < start + 8:
            break
        (size,) = struct.unpack_from("<Q", blob, start)
        if size > len(blob) - start - 8:
            continue
        try:
            tree = json.loads(zlib.decompress(blob[start + 8 : start + 8 + size]))
        except (zlib.error, ValueError):
            continue
        return _Codec(blob[:start], tree, blob[start + 8 + size :])
    return None


def _raw_mutation(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    op = rng.choice(["truncate", "flip", "append"])
    if op == "truncate":
        cut = rng.randrange(len(blob) + 1)
        return f"truncated to {cut} of {len(blob)} bytes", blob[:cut]
    if op == "flip" and blob:
        at = rng.randrange(len(blob))
        changed = bytearray(blob)
        changed[at] ^= 1 << rng.randrange(8)
        return f"bit flipped at byte {at}", bytes(changed)
    return "a byte appended", blob + b"\x00"


def _blob_mutant(seed: Seed, rng: random.Random) -> tuple[str, bytes, bool]:
    codec = _codec(seed.blob)
    roll = rng.random()
    if codec is None or roll < 0.06:
        what, blob = _raw_mutation(seed.blob, rng)
        return what, blob, False
    if roll < 0.10:
        # The same JSON spelled otherwise: an unchanged program, so eager's answer.
        return "re-encoded (same JSON)", codec.encode(codec.tree, indent=1, sort_keys=True), True
    if codec.prefix and roll < 0.14:
        # The header's length field, or the data after the header.
        if rng.random() < 0.5:
            changed = bytearray(seed.blob)
            size = rng.choice([0, 1, 2**31, 2**63, 2**64 - 1, len(seed.blob)])
            struct.pack_into("<Q", changed, len(codec.prefix), size)
            return f"header length = {size}", bytes(changed), False
        cut = rng.randrange(len(codec.data) + 1)
        return (
            f"data truncated to {cut} bytes",
            codec.encode(codec.tree)[: len(seed.blob) - len(codec.data) + cut],
            False,
        )
    paths = list(_paths(codec.tree))
    path = rng.choice(paths)
    value = codec.tree
    for key in path:
        value = value[key]
    what, new = _mutate_value(value, rng, _strings(codec.tree))
    try:
        blob = codec.encode(_set(codec.tree, path, new))
    except ValueError:  # a value json cannot write (nan is written, so none here)
        return "unchanged", seed.blob, True
    return f"{_show_path(path)} {what}", blob, False


def _pte_mutant(seed: Seed, rng: random.Random, fields: Sequence[Any]) -> tuple[str, bytes, bool]:
    if rng.random() < 0.03:
        what, blob = _raw_mutation(seed.blob, rng)
        return what, blob, False
    chosen = rng.choice(fields)
    size = struct.calcsize(chosen.fmt)
    old = chosen.read(seed.blob)
    bits = 8 * size
    candidates = [0, 1, -1, old + 1, old - 1, -old, old * 2, 2 ** (bits - 1) - 1, -(2 ** (bits - 1)), 2**bits - 1]
    candidates += [rng.randrange(2**bits), 2**31 - 1, 2**31, 2**16, 255, 7]
    new = rng.choice(candidates) % (2**bits)
    changed = bytearray(seed.blob)
    changed[chosen.offset : chosen.offset + size] = new.to_bytes(size, "little")
    return (
        f"{chosen.path} = {struct.unpack_from(chosen.fmt, changed, chosen.offset)[0]} (was {old})",
        bytes(changed),
        False,
    )


def make_mutant(
    seeds: Sequence[Seed], seed: int, target: str, index: int, fields: Any = None
) -> tuple[Seed, str, bytes, bool]:
    """Mutant ``index`` of ``target``: ``(its seed, the mutated path, bytes, unchanged?)``.

    Drawn from ``Random(f"{seed}:{target}:{index}")`` alone: the same arguments make
    the same mutant in any process. ``fields`` (per seed, for ``pte``) are
    :func:`~writeback_testing.ptefields.plan_fields` of each seed's program.
    """
    rng = random.Random(f"{seed}:{target}:{index}")
    k = rng.randrange(len(seeds))
    chosen = seeds[k]
    if target == "pte":
        what, blob, same = _pte_mutant(chosen, rng, fields[k])
    else:
        what, blob, same = _blob_mutant(chosen, rng)
    return chosen, f"{chosen.program}: {what}", blob, same


# --- the oracle --------------------------------------------------------------------------------


def classify_error(error: BaseException) -> Outcome:
    """``refused`` for a clean error, ``escaped`` for an internal one (see the module doc)."""
    from writeback_core.blob import BlobError

    message = str(error)
    described = f"{type(error).__name__}: {message[:300]}"
    if isinstance(error, BlobError):
        return Outcome("refused", described)
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    cause = error.__cause__
    if cause is not None and not isinstance(error, BlobError):
        inner = classify_error(cause)
        if inner.kind == "escaped":
            return Outcome("escaped", f"{described} <- {inner.detail}")
    if not isinstance(error, _CLEAN_TYPES) or not message.strip():
        return Outcome("escaped", described + where)
    if any(text in message for text in _PYTHON_MESSAGES):
        return Outcome("escaped", described + where)
    if frames:
        line = (frames[-1].line or linecache.getline(frames[-1].filename, frames[-1].lineno or 0)).strip()
        if line.startswith("raise"):
            return Outcome("refused", described)
        if "mx." in line or "mlx" in frames[-1].filename:
            return Outcome("escaped", f"{described}{where}: an MLX error surfacing as is")
    return Outcome("refused", described)


def _close(got: Any, expected: Any) -> bool:
    import torch

    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    return bool(torch.allclose(got.double(), expected.double(), atol=1e-4, rtol=1e-4, equal_nan=True))


def _answer_differs(seed: Seed, args: Sequence[Any], outputs: Sequence[Any] | None) -> str | None:
    """Why the call's answer is not eager's: each output in its slot, or (a delegate writing
    state in place) in one of its inputs."""
    got = list(outputs) if outputs is not None else list(args[seed.num_inputs :])
    for k, expected in enumerate(seed.expected):
        if k < len(got) and _close(got[k], expected):
            continue
        if outputs is None and any(_close(a, expected) for a in args[: seed.num_inputs]):
            continue
        shown = got[k].flatten()[:6].tolist() if k < len(got) and hasattr(got[k], "flatten") else "nothing"
        return f"output {k}: expected {expected.flatten()[:6].tolist()}, got {shown}"[:300]
    return None


class _Runner:
    """Runs mutants of one target through the real path, reusing delegates and runtime."""

    def __init__(self, registry: Any, target: str, seeds: list[Seed] | None = None) -> None:
        self.target = target
        self.registry = registry
        self.seeds = build_seeds(registry, target) if seeds is None else seeds
        if not self.seeds:
            raise ValueError(f"target {target!r}: no seed program lowers to it")
        self.delegates = registry.runtime_delegates()
        self.fields: list[Any] = []
        if target == "pte":
            from writeback_testing.oracle import registry_runtime
            from writeback_testing.ptefields import plan_fields

            runtime = registry_runtime(registry)
            if runtime is None:
                raise ValueError("target 'pte': the registry offers no runtime (writeback_runtimes)")
            self.runtime = runtime
            self.fields = [plan_fields(s.blob) for s in self.seeds]

    def run(self, seed: Seed, blob: bytes, unchanged: bool) -> Outcome:
        import torch

        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in seed.args]
        outputs: list[Any] | None = None
        try:
            if self.target == "pte":
                method = self.runtime.spec.load_program(blob, self.delegates).load_method("forward")
                outputs = list(method.execute(args))
                outputs = outputs[len(outputs) - len(seed.expected) :]
            else:
                delegate = self.delegates[seed.backend_id]
                handle = delegate.init(blob, seed.specs)
                try:
                    delegate.execute(handle, args)
                finally:
                    delegate.destroy(handle)
        except Exception as error:
            outcome = classify_error(error)
            if unchanged:
                return Outcome("wrong", f"an unchanged program was refused: {outcome.detail}")
            return outcome
        if not unchanged:
            return Outcome("ran")
        differs = _answer_differs(seed, args, outputs)
        return Outcome("wrong", differs) if differs else Outcome("equal")


def run_mutant(runner: _Runner, seed: int, index: int) -> tuple[str, Outcome]:
    """Make mutant ``index`` of the runner's target and run it: ``(its path, outcome)``."""
    chosen, path, blob, unchanged = make_mutant(runner.seeds, seed, runner.target, index, runner.fields)
    return path, runner.run(chosen, blob, unchanged)


# --- worker and driver -------------------------------------------------------------------------


def _registry(plugins: Sequence[str]) -> Any:
    import importlib

    from writeback_core.registry import load_registry

    return load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in plugins])


def _worker(
    target: str, seed: int, start: int, stop: int, plugins: Sequence[str], seeds: list[Seed] | None = None
) -> int:
    """Run mutants ``[start, stop)``: print ``> i path`` before each, ``= i kind detail`` after."""
    from writeback_core.quiet import quiet_upstream_noise

    quiet_upstream_noise()
    out = sys.stdout
    runner = _Runner(_registry(plugins), target, seeds)
    # Check the seeds themselves first: each unchanged program must give eager's answer.
    if start == 0:
        for k, s in enumerate(runner.seeds):
            outcome = runner.run(s, s.blob, True)
            if outcome.kind != "equal":
                out.write(json.dumps({"i": -1 - k, "path": f"{s.program}: the seed itself", **vars(outcome)}) + "\n")
    out.write("ready\n")
    out.flush()
    # The harness's own test: abort (as a crashing mutant would) at this index.
    abort_at = int(os.environ.get(ABORT_AT_ENV, "-1"))
    for index in range(start, stop):
        chosen, path, blob, unchanged = make_mutant(runner.seeds, seed, target, index, runner.fields)
        out.write(f"> {index} {path}\n")
        out.flush()
        if index == abort_at:
            os.abort()
        outcome = runner.run(chosen, blob, unchanged)
        out.write(json.dumps({"i": index, "path": path, **vars(outcome)}) + "\n")
        out.flush()
    return 0


class _Lines:
    """Lines of a worker's stdout, each waited for at most ``timeout`` seconds."""

    def __init__(self, stream: Any) -> None:
        self.fd = stream.fileno()
        self.buffer = b""

    def next(self, timeout: float) -> str | None:
        """The next line; ``None`` at end of stream; ``TimeoutError`` when none came in time."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace")


def _serve(plugins: Sequence[str]) -> int:
    """The fork server (``serve`` mode): imports torch, exir and the plugins once and keeps
    each target's seeds; per request line on stdin (``{"target", "seed", "start", "stop",
    "stderr"}``) it forks a worker that prints ``pid N``, then runs as :func:`_worker` with
    those seeds, its stderr going to the request's file. When the worker ends (or dies) the
    server prints ``exit CODE`` (negative for a signal, as ``subprocess`` gives it)."""
    import torch
    from writeback_core.quiet import quiet_upstream_noise

    quiet_upstream_noise()
    # OpenMP (libgomp) is not fork-safe: a worker forked after the server ran a parallel
    # region hangs in its own first one. The server runs on one thread (no OpenMP team is
    # made); each worker goes back to the threads a fresh interpreter has.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for line in sys.stdin:
        request = json.loads(line)
        code = _serve_request(request, plugins, threads)
        sys.stdout.write(f"exit {code}\n")
        sys.stdout.flush()
    return 0


def _serve_request(request: dict[str, Any], plugins: Sequence[str], threads: int) -> int:
    own_stderr = os.dup(2)
    try:
        with open(request["stderr"], "ab") as err:
            os.dup2(err.fileno(), 2)
        try:
            seeds = seeds_of(request["target"], plugins)
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            return 1
        sys.stdout.flush()
        sys.stderr.flush()
        import torch

        pid = os.fork()
        if pid == 0:  # the worker: run the range, then exit without the server's cleanup
            code = 1
            try:
                sys.stdout.write(f"pid {os.getpid()}\n")
                torch.set_num_threads(threads)
                code = _worker(request["target"], request["seed"], request["start"], request["stop"], plugins, seeds)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    finally:
        os.dup2(own_stderr, 2)
        os.close(own_stderr)


class _Server:
    """A fork server (:func:`_serve`) of this process, for one set of plugins and one environment."""

    def __init__(self, plugins: Sequence[str], env: dict[str, str] | None, stderr_path: str) -> None:
        command = [sys.executable, "-m", "writeback_testing.blobfuzz", "serve", "--plugins", ",".join(plugins)]
        # Until its first request redirects it, the server's stderr (imports) is that request's.
        with open(stderr_path, "wb") as err_file:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file, env=env
            )
        assert self.process.stdout is not None
        self.lines = _Lines(self.process.stdout)

    def request(self, **fields: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(fields) + "\n").encode())
        self.process.stdin.flush()

    def close(self) -> None:
        """End the server (it exits when its stdin closes; killed if it does not)."""
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# This process's fork servers, by plugins and environment (``None``: this process's, as
# it was when the server started); ended at exit.
_SERVERS: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...] | None], _Server] = {}


def _server(plugins: Sequence[str], env: dict[str, str] | None, stderr_path: str) -> _Server:
    key = (tuple(plugins), None if env is None else tuple(sorted(env.items())))
    server = _SERVERS.get(key)
    if server is None or server.process.poll() is not None:
        if not _SERVERS:
            atexit.register(_close_servers)
        server = _SERVERS[key] = _Server(plugins, env, stderr_path)
    return server


def _end_server(server: _Server) -> None:
    """Kill ``server`` (mid-request: its worker hung or the caller failed) and forget it."""
    for key in [k for k, v in _SERVERS.items() if v is server]:
        del _SERVERS[key]
    server.process.kill()
    server.close()


def _close_servers() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def _stderr_tail(path: str) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - 1500))
        lines = handle.read().decode("utf-8", "replace").strip().splitlines()
    return " | ".join(lines[-4:])


def run_blob_fuzz(
    targets: Sequence[str] | None = None,
    mutants: int = 1000,
    seed: int = 0,
    plugins: Sequence[str] = DEFAULT_PLUGINS,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> BlobFuzzReport:
    """Run ``mutants`` mutants of each target (default: every target the plugins offer) in
    worker processes (forked by a fork server that outlives the call: the next call with
    the same plugins and environment reuses it); a worker that dies or hangs is recorded
    as a finding and replaced by one starting after that mutant.

    :param timeout: seconds a worker may take to start (the fork server to start and
        build the seeds), and then per mutant.
    :param env: the workers' environment (default: this process's, as it was when the
        first call started the fork server).
    :param progress: called with ``(target, mutants done)`` as results arrive.
    """
    report = BlobFuzzReport()
    started = time.perf_counter()
    if targets is None:
        targets = targets_of(_registry(plugins))
    for target in targets:
        counts = report.counts.setdefault(target, Counter())
        index = 0
        while index < mutants:
            index = _run_worker(target, seed, index, mutants, plugins, timeout, env, report, counts, progress)
    report.seconds = time.perf_counter() - started
    return report


def _run_worker(
    target: str,
    seed: int,
    start: int,
    stop: int,
    plugins: Sequence[str],
    timeout: float,
    env: dict[str, str] | None,
    report: BlobFuzzReport,
    counts: Counter[str],
    progress: Callable[[str, int], None] | None,
) -> int:
    """One worker over ``[start, stop)``, forked by this process's fork server for ``plugins``
    and ``env``; returns where the next worker starts."""
    with tempfile.NamedTemporaryFile(prefix="blobfuzz-", suffix=".stderr", delete=False) as err:
        stderr_path = err.name
    server: _Server | None = None
    worker: int | None = None
    finished = False
    try:
        server = _server(plugins, env, stderr_path)
        server.request(target=target, seed=seed, start=start, stop=stop, stderr=stderr_path)
        current: tuple[int, str] | None = None
        ready = False
        code: int | None = None
        while code is None:
            try:
                line = server.lines.next(timeout)
            except TimeoutError:
                if current is None:
                    raise RuntimeError(
                        f"the {target} worker did not start in {timeout:.0f} s: {_stderr_tail(stderr_path)}"
                    ) from None
                counts["hang"] += 1
                report.findings.append(
                    Finding(target, seed, current[0], current[1], Outcome("hang", f"no result in {timeout:.0f} s"))
                )
                report.restarts += 1
                return current[0] + 1
            if line is None:  # the server itself died
                code = server.process.wait()
            elif line.startswith("exit "):
                code = int(line[5:])
                finished = True
            elif line.startswith("pid "):
                worker = int(line[4:])
            elif line == "ready":
                ready = True
            elif line.startswith("> "):
                number, _, path = line[2:].partition(" ")
                current = (int(number), path)
            elif line.startswith("{"):
                record = json.loads(line)
                outcome = Outcome(record["kind"], record["detail"])
                if record["i"] >= 0:
                    counts[outcome.kind] += 1
                    current = None
                    if progress is not None:
                        progress(target, record["i"] + 1)
                if outcome.kind in _FINDINGS:
                    report.findings.append(Finding(target, seed, record["i"], record["path"], outcome))
        if current is not None:
            signal_text = f"signal {-code}" if code < 0 else f"exit {code}"
            counts["crash"] += 1
            detail = f"the worker died ({signal_text}): {_stderr_tail(stderr_path)}"
            report.findings.append(Finding(target, seed, current[0], current[1], Outcome("crash", detail)))
            report.restarts += 1
            return current[0] + 1
        if code != 0 or not ready:
            raise RuntimeError(
                f"the {target} worker failed (exit {code}) outside any mutant: {_stderr_tail(stderr_path)}"
            )
        return stop
    finally:
        if not finished:  # a hang, or an error here: end the worker and its server
            if worker is not None:
                try:
                    os.kill(worker, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if server is not None:
                _end_server(server)
        os.unlink(stderr_path)


def _repro(target: str, seed: int, index: int, plugins: Sequence[str]) -> int:
    runner = _Runner(_registry(plugins), target)
    chosen, path, blob, unchanged = make_mutant(runner.seeds, seed, target, index, runner.fields)
    print(f"{target} mutant {index} (seed {seed}): {path}", flush=True)
    outcome = runner.run(chosen, blob, unchanged)
    print(f"{outcome.kind}: {outcome.detail}")
    return 1 if outcome.kind in _FINDINGS else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m writeback_testing.blobfuzz", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["worker", "serve", "repro", "run"])
    parser.add_argument("--target", action="append", help="pte, backend:NAME or engine:NAME (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--stop", type=int, default=100)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--mutants", type=int, default=1000)
    parser.add_argument("--plugins", default=",".join(DEFAULT_PLUGINS))
    options = parser.parse_args(argv)
    plugins = [p for p in options.plugins.split(",") if p]
    if options.mode == "worker":
        return _worker(options.target[0], options.seed, options.start, options.stop, plugins)
    if options.mode == "serve":
        return _serve(plugins)
    if options.mode == "repro":
        return _repro(options.target[0], options.seed, options.index, plugins)
    report = run_blob_fuzz(options.target, options.mutants, options.seed, plugins)
    print(report.summary())
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
