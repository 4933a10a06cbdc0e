"""The kv-alias engine: a real ExecuTorch delegate that, like TensorRT, aliases only cache
writes (its options and rule: :mod:`.kv_alias_options`; its lowering: :mod:`.kv_alias_backend`).
"""

from __future__ import annotations

from typing import Any

from writeback_trt_copyback.kv_alias_options import BACKEND_ID, KVAliasOptions, op_excluded

__all__ = ["BACKEND_ID", "KVAliasEngine", "op_excluded"]


class KVAliasEngine(KVAliasOptions):
    """An :class:`~writeback_core.types.AliasingEngine` backed by this package's delegate
    (:class:`~writeback_trt_copyback.kv_alias_options.KVAliasOptions` and its partitioner)."""

    def partitioner(self) -> Any:
        """A fresh exir ``Partitioner`` that hands this engine every op it can take."""
        from writeback_trt_copyback.kv_alias_backend import KVAliasPartitioner

        return KVAliasPartitioner(self)
