"""The kv-alias engine's options and rule, without its exir partitioner (:mod:`.engine` adds
it): what the engine's lowering (:mod:`.kv_alias_backend`) reads back from its compile specs.

The kv-alias engine: a real ExecuTorch delegate that, like TensorRT, aliases only cache writes.

It takes every aten op it is offered (minus ``excluded_ops``) and recomputes
them in Python with torch; a write its rule accepts is performed **in place**
into the delegate input that holds the cache (the caller-visible buffer), and
reported in :meth:`KVAliasOptions.aliased_io`. Every other write is computed
into a fresh tensor and must be copied back by the program.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from writeback_core.types import EngineWrite

from writeback_trt_copyback.rule import TensorRTCacheRule

__all__ = ["BACKEND_ID", "KVAliasOptions", "op_excluded"]

# The exir ``BackendDetails`` subclass's name, which is what delegate blobs carry.
BACKEND_ID = "WritebackKVAliasBackend"

_SPEC_KEY = "writeback.kv_alias.options"


def op_excluded(op: str | None, excluded: Iterable[str]) -> bool:
    """Whether ``op`` (``aten.index_put.default``) is kept out of the engine by ``excluded``.

    An entry names one overload (``aten.index_put.default``) or every overload
    of an op (``aten.index_put``). The partitioner and the predicate both call
    this, so what the engine is never offered and what it is predicted not to
    alias cannot disagree.
    """
    if op is None:
        return False
    packet = op.rsplit(".", 1)[0]
    return any(entry in (op, packet) for entry in excluded)


@dataclass(frozen=True)
class KVAliasOptions:
    """An :class:`~writeback_core.types.AliasingEngine` backed by this package's delegate.

    ``excluded_ops`` stay outside the engine (run by ExecuTorch's kernels);
    ``min_block_size`` leaves a partition of fewer ops outside, as TensorRT
    does, which no prediction can see coming (the cross-check catches it).
    """

    name: str = "kv-alias"
    backend_id: str = BACKEND_ID
    rule: TensorRTCacheRule = field(default_factory=TensorRTCacheRule)
    excluded_ops: tuple[str, ...] = ()
    min_block_size: int = 1

    def alias_refusal(self, write: EngineWrite) -> str | None:
        """The rule, after the exclusion list: an excluded op never reaches the engine."""
        if op_excluded(write.write.op, self.excluded_ops):
            return f"{write.write.op} is excluded from the engine (excluded_ops)"
        return self.rule.alias_refusal(write)

    def aliased_io(self, processed: bytes) -> Mapping[str, int]:
        """Read from the lowered blob: each in-place write's binding -> delegate input index."""
        from writeback_trt_copyback._blob import Blob

        return dict(Blob.from_bytes(processed).aliased_io)

    def compile_specs(self) -> list[Any]:
        """The options as exir ``CompileSpec`` s, read back by the engine's ``preprocess``."""
        from executorch.exir.backend.compile_spec_schema import CompileSpec

        options = {
            "excluded_ops": list(self.excluded_ops),
            "min_block_size": self.min_block_size,
            "rank": self.rule.rank,
            "seq_dim": self.rule.seq_dim,
        }
        return [CompileSpec(_SPEC_KEY, json.dumps(options, sort_keys=True).encode())]

    @classmethod
    def from_compile_specs(cls, specs: Iterable[Any]) -> Self:
        """The engine whose :meth:`compile_specs` produced ``specs``."""
        for spec in specs:
            if spec.key == _SPEC_KEY:
                options = json.loads(bytes(spec.value).decode())
                return cls(
                    rule=TensorRTCacheRule(rank=options["rank"], seq_dim=options["seq_dim"]),
                    excluded_ops=tuple(options["excluded_ops"]),
                    min_block_size=int(options["min_block_size"]),
                )
        return cls()
