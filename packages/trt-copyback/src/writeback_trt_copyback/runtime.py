"""The kv-alias engine's runtime delegate, offered through ``writeback_runtime_delegates``.

A runtime (the pybind-runtime) registers it as an ExecuTorch backend and calls
``execute`` with zero-copy tensor views of the delegate's arguments: the
inputs, then the outputs, already allocated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from writeback_trt_copyback._blob import Blob, decode_arg, decode_tensor, resolve_op
from writeback_trt_copyback.engine import BACKEND_ID

__all__ = ["KVAliasRuntimeDelegate"]


@dataclass
class _Plan:
    blob: Blob
    ops: dict[str, Any]
    constants: dict[str, torch.Tensor]
    skipped_outputs: frozenset[int]


def _update(step: dict[str, Any], cache: torch.Tensor, env: dict[str, Any]) -> None:
    """Write one accepted cache update into ``cache`` in place (only the slots it covers)."""
    kind = step["update"]
    src = decode_arg(step["src"], env)
    if kind == "slice":
        cache.narrow(step["dim"], step["start"], step["length"]).copy_(src)
    elif kind == "index_put":
        torch.ops.aten.index_put_.default(cache, decode_arg(step["indices"], env), src)
    else:
        cache.index_copy_(step["dim"], decode_arg(step["index"], env), src)


class KVAliasRuntimeDelegate:
    """``init`` / ``execute`` / ``destroy`` for blobs of ``WritebackKVAliasBackend``."""

    backend_id = BACKEND_ID

    def init(self, processed: bytes, compile_specs: Mapping[str, bytes]) -> _Plan:
        blob = Blob.from_bytes(bytes(processed))
        ops = {s["op"]: resolve_op(s["op"]) for s in blob.steps if "op" in s}
        skipped = frozenset(int(b[len("output") :]) for b in blob.aliased_io if b.startswith("output"))
        constants = {k: decode_tensor(v) for k, v in blob.constants.items()}
        return _Plan(blob, ops, constants, skipped)

    def execute(self, handle: _Plan, args: Sequence[Any]) -> None:
        blob = handle.blob
        n_in = len(blob.inputs)
        if len(args) != n_in + len(blob.outputs):
            raise ValueError(
                f"kv-alias delegate expects {n_in} inputs and {len(blob.outputs)} outputs, got {len(args)} arguments"
            )
        env: dict[str, Any] = dict(handle.constants)
        env.update(zip(blob.inputs, args[:n_in], strict=True))
        for step in blob.steps:
            if "update" in step:
                cache = args[step["input"]]
                _update(step, cache, env)
                env[step["name"]] = cache
                continue
            call = handle.ops[step["op"]]
            env[step["name"]] = call(*decode_arg(step["args"], env), **decode_arg(step["kwargs"], env))
        for k, ref in enumerate(blob.outputs):
            if k in handle.skipped_outputs:
                continue
            out, value = args[n_in + k], decode_arg(ref, env)
            if isinstance(out, torch.Tensor) and isinstance(value, torch.Tensor):
                out.copy_(value)

    def destroy(self, handle: _Plan) -> None:
        handle.ops.clear()
