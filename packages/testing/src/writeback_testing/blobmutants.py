"""The blob fuzzer's mutations (step 2 of :mod:`writeback_testing.blobfuzz`): mutant ``i``
of a target is drawn from ``Random(f"{seed}:{target}:{i}")`` alone (:func:`make_mutant`). It
changes one field of a delegate blob's JSON (plain, or the zlib-compressed header of a
``MAGIC | length | zlib(JSON) | data`` blob, read and written back by the :class:`Codec` of
:func:`codec_of`), truncates or flips its bytes, changes its length field, re-encodes the same
JSON, or changes one scalar of a ``.pte``'s execution plan in place.
"""

from __future__ import annotations

import copy
import json
import math
import random
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from writeback_testing.blobseeds import Seed

__all__ = ["Codec", "codec_of", "make_mutant"]


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
class Codec:
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


def codec_of(blob: bytes) -> Codec | None:
    try:
        return Codec(b"", json.loads(blob), b"")
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
        return Codec(blob[:start], tree, blob[start + 8 + size :])
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
    codec = codec_of(seed.blob)
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
