"""Helpers for the hostile-input tests: walk a decoded JSON blob field by field and give each
field values of other JSON types (every delegate); write broken model folders (the folder
checks of every command that reads one)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def fields(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into ``value`` (the root's ``()`` first), depth first."""
    yield path
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from fields(inner, (*path, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from fields(inner, (*path, index))


def at(record: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        record = record[key]
    return record


def wrong_values(value: Any, ref_tag: str) -> list[Any]:
    """Values of other JSON types than ``value`` (``ref_tag`` spells the delegate's reference)."""
    if value is None:
        return [{ref_tag: 7}, "x"]
    if isinstance(value, bool):
        return ["yes", 1.5]
    if isinstance(value, int):
        return ["3", 2.5, None, [value]]
    if isinstance(value, str):
        return [7, None, [value], {ref_tag: value}]
    if isinstance(value, list):
        return [{"x": 1}, "list"]
    return [[1], "object"]


def replaced(record: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A deep copy of ``record`` with the field at ``path`` set to ``value``."""
    changed = copy.deepcopy(record)
    at(changed, path[:-1])[path[-1]] = value
    return changed


# Hostile model folders ------------------------------------------------------------------
# A tiny Llama folder written from scratch (config.json and a safetensors file whose
# header this module writes itself, so that it can also write headers that lie), and
# each way a careless or hostile folder breaks it, with the words a refusal must say.

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "I8": "int8"}


def tiny_llama_tensors(config: dict[str, Any] = TINY_LLAMA_CONFIG, seed: int = 0) -> dict[str, Any]:
    """Every parameter of ``LlamaForCausalLM`` for ``config``, seeded, small values."""
    import torch

    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.05 for name, shape in shapes.items()}


def safetensors_bytes(tensors: dict[str, Any], header_edit: Any = None) -> bytes:
    """A safetensors file of ``tensors`` (torch tensors), its header written here;
    ``header_edit(header)`` may change the header dict before it is written."""
    import torch

    names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "I8"}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for name, tensor in tensors.items():
        # numpy has no bfloat16: its bytes are those of the same-sized int16 view.
        bits = tensor.contiguous().view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor.contiguous()
        raw = bits.numpy().tobytes()
        kind = names[str(tensor.dtype).removeprefix("torch.")]
        header[name] = {"dtype": kind, "shape": list(tensor.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if header_edit is not None:
        header_edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + bytes(data)


def write_folder(folder: Path, config: Any = None, tensors: dict[str, Any] | None = None) -> Path:
    """A tiny Llama folder at ``folder``: ``config`` (a dict, default the tiny one) and ``tensors``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG if config is None else config))
    (folder / "model.safetensors").write_bytes(safetensors_bytes(tiny_llama_tensors() if tensors is None else tensors))
    return folder


def _with_config(**changes: Any) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        config = dict(TINY_LLAMA_CONFIG) | changes
        write_folder(folder, {k: v for k, v in config.items() if v is not _DROP})

    return make


_DROP = object()
Q0 = "model.layers.0.self_attn.q_proj.weight"


def _with_tensors(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        tensors = tiny_llama_tensors()
        edit(tensors)
        write_folder(folder, tensors=tensors)

    return make


def _with_header(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        write_folder(folder)
        (folder / "model.safetensors").write_bytes(safetensors_bytes(tiny_llama_tensors(), edit))

    return make


def _truncated(folder: Path) -> None:
    write_folder(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])


def _weights_replaced(replace_weights: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        write_folder(folder)
        replace_weights(folder)

    return make


def _config_replaced(make_config: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        write_folder(folder)
        (folder / "config.json").unlink()
        make_config(folder / "config.json")

    return make


def _weights_dev_zero(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/dev/zero")


def _pickle_only(folder: Path) -> None:
    write_folder(folder)
    (folder / "model.safetensors").unlink()
    # A pickle that would create a file if anything unpickled it.
    sentinel = folder / "UNPICKLED"
    payload = f"cos\nsystem\n(S'touch {sentinel}'\ntR.".encode()
    (folder / "pytorch_model.bin").write_bytes(payload)


def _deep(folder: Path) -> None:
    write_folder(folder)
    text = json.dumps(TINY_LLAMA_CONFIG)
    (folder / "config.json").write_text(text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _int8(tensors: dict[str, Any]) -> None:
    import torch

    tensors[Q0] = (tensors[Q0] * 1000).to(torch.int8)


def _nan(tensors: dict[str, Any]) -> None:
    tensors[Q0][3, 5] = float("nan")


@dataclass(frozen=True)
class HostileFolder:
    """One broken folder: how to write it and what its refusal must name."""

    name: str
    make: Callable[[Path], None]
    says: tuple[str, ...]


HOSTILE_FOLDERS: tuple[HostileFolder, ...] = (
    HostileFolder("truncated-header", _truncated, ("model.safetensors", "header claims", "cut short")),
    HostileFolder(
        "lying-offsets",
        _with_header(lambda h: h[Q0].__setitem__("data_offsets", [0, 1 << 40])),
        (Q0, "data_offsets", "1099511627776"),
    ),
    HostileFolder(
        "lying-dtype",
        _with_header(lambda h: h[Q0].__setitem__("dtype", "F16")),
        (Q0, "needs 8192 bytes", "16384"),
    ),
    HostileFolder(
        "wrong-shape",
        _with_tensors(lambda t: t.__setitem__(Q0, t[Q0][:32])),
        (Q0, "[32, 64]", "[64, 64]"),
    ),
    HostileFolder("vocab-0", _with_config(vocab_size=0), ("vocab_size is 0",)),
    HostileFolder("vocab-2^31", _with_config(vocab_size=1 << 31), ("vocab_size is 2147483648",)),
    HostileFolder(
        "heads-not-dividing",
        _with_config(num_attention_heads=3, num_key_value_heads=3, head_dim=_DROP),
        ("num_attention_heads 3", "hidden_size 64"),
    ),
    HostileFolder("layers-minus-1", _with_config(num_hidden_layers=-1), ("num_hidden_layers is -1",)),
    HostileFolder("layers-10^6", _with_config(num_hidden_layers=10**6), ("too large", "1,000,000 layers", "GiB")),
    HostileFolder("max-positions-0", _with_config(max_position_embeddings=0), ("max_position_embeddings is 0",)),
    HostileFolder("deep-config", _deep, ("config.json", "nests 100001 levels")),
    HostileFolder("pickle-only", _pickle_only, ("pytorch_model.bin", "pickle", "safetensors")),
    HostileFolder(
        "weights-dev-zero",
        _weights_replaced(_weights_dev_zero),
        ("model.safetensors", "not a regular file"),
    ),
    HostileFolder(
        "config-symlink-loop",
        _config_replaced(lambda p: p.symlink_to(p.name)),
        ("config.json", "symbolic links"),
    ),
    HostileFolder("config-directory", _config_replaced(lambda p: p.mkdir()), ("config.json", "is a directory")),
    HostileFolder(
        "config-dev-zero", _config_replaced(lambda p: p.symlink_to("/dev/zero")), ("config.json", "not a regular file")
    ),
    HostileFolder(
        "remote-code",
        _with_config(model_type="writeback-hostile", auto_map={"AutoModelForCausalLM": "modeling.Hostile"}),
        ("auto_map", "never runs code"),
    ),
    HostileFolder("missing-q-proj", _with_tensors(lambda t: t.pop(Q0)), (Q0, "missing", "--accept-weights")),
    HostileFolder("int8-weights", _with_tensors(_int8), (Q0, "I8", "--accept-weights")),
    HostileFolder("nan-weights", _with_tensors(_nan), (Q0, "nan", "--accept-weights")),
    HostileFolder(
        "unexpected-tensor",
        _with_tensors(lambda t: t.__setitem__("model.layers.0.extra.weight", t[Q0].clone())),
        ("model.layers.0.extra.weight", "unexpected", "--accept-weights"),
    ),
)

# The cases --accept-weights lets through (the rest it cannot).
ACCEPTABLE = frozenset({"missing-q-proj", "int8-weights", "nan-weights", "unexpected-tensor"})
