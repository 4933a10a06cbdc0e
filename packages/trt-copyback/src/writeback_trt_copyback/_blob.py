"""The processed blob of the kv-alias engine: a JSON program of aten calls and in-place updates.

Private to the engine: written by its ``preprocess``, read by its runtime delegate
and by ``KVAliasEngine.aliased_io``. Values are referenced by node name; tensors
that the partition owns (none, unless a partitioner tags constants) travel as
``torch.save`` bytes in base64.
"""

from __future__ import annotations

import base64
import io
import json
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

FORMAT = "writeback-kv-alias/1"

# How a non-JSON argument is spelled: a one-key dict whose key says what it is.
_REF, _DTYPE, _DEVICE, _MEMFMT, _LAYOUT = "$ref", "$dtype", "$device", "$memory_format", "$layout"


@dataclass
class Blob:
    """A lowered partition: ``steps`` run in order over the delegate's inputs."""

    inputs: list[str]
    steps: list[dict[str, Any]]
    outputs: list[Any]
    aliased_io: dict[str, int] = field(default_factory=dict)
    marked: list[str] = field(default_factory=list)
    constants: dict[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, **self.__dict__}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Blob:
        try:
            record = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a kv-alias engine blob ({error})") from error
        if not isinstance(record, dict) or record.pop("format", None) != FORMAT:
            raise ValueError(f"not a kv-alias engine blob (expected format {FORMAT!r})")
        return cls(**record)


def encode_tensor(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor.detach().clone(), buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def decode_tensor(text: str) -> torch.Tensor:
    loaded = torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    assert isinstance(loaded, torch.Tensor)
    return loaded


def encode_arg(value: Any) -> Any:
    """A graph argument as JSON; nodes become references by name."""
    if isinstance(value, torch.fx.Node):
        return {_REF: value.name}
    if isinstance(value, (list, tuple)):
        return [encode_arg(v) for v in value]
    if isinstance(value, dict):
        return {"$dict": {k: encode_arg(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_DEVICE: str(value)}
    if isinstance(value, torch.memory_format):
        return {_MEMFMT: str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {_LAYOUT: str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"the kv-alias engine cannot serialize argument {value!r} ({type(value).__name__})")


def decode_arg(value: Any, env: dict[str, Any]) -> Any:
    """Inverse of :func:`encode_arg`, resolving references in ``env``."""
    if isinstance(value, list):
        return [decode_arg(v, env) for v in value]
    if isinstance(value, dict):
        ((key, inner),) = value.items()
        if key == _REF:
            return env[inner]
        if key == "$dict":
            return {k: decode_arg(v, env) for k, v in inner.items()}
        if key == _DEVICE:
            return torch.device(inner)
        return getattr(torch, inner)
    return value


def op_key(target: Any) -> str:
    """``aten.add.Tensor`` for an aten (or edge-wrapped) op; ``getitem`` for ``operator.getitem``."""
    if target is operator.getitem:
        return "getitem"
    inner = getattr(target, "_op", target)
    if isinstance(inner, torch._ops.OpOverload):
        return str(inner)
    raise TypeError(f"the kv-alias engine cannot run {target!r}")


def resolve_op(key: str) -> Any:
    """The callable an :func:`op_key` names."""
    if key == "getitem":
        return operator.getitem
    namespace, name, overload = key.split(".")
    if namespace == "dim_order_ops":
        # exir registers its dim-order ops with torch on import.
        import executorch.exir.passes.dim_order_ops_registry  # noqa: F401
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)
