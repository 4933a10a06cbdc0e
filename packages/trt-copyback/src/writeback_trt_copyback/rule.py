"""TensorRT's rule for which writes its engine aliases, the default predicate of this package."""

from __future__ import annotations

from dataclasses import dataclass

from writeback_core.mutations import Dynamic, WriteKind
from writeback_core.types import EngineWrite

from writeback_trt_copyback.derive import WriteStatus, resolve_bounds

__all__ = ["TensorRTCacheRule"]

# Why a write that takes one of the derivation's early exits cannot be aliased.
_STATUS_REASONS = {
    WriteStatus.FULL_OVERWRITE: "{write}: no cache slot to alias",
    WriteStatus.NOT_A_SLICE_OR_INDEX: "it is not a slice or index-copy write ({write})",
    WriteStatus.DYNAMIC_BOUNDS: "a bound is known only at run time ({write})",
    WriteStatus.BAD_DIM: "its dim does not index the cache ({write})",
}


@dataclass(frozen=True)
class TensorRTCacheRule:
    """Alias a write only when TensorRT's KV-cache update layer could express it.

    The layer writes ``length`` consecutive slots of a 4-D ``[batch, heads,
    seq, head_dim]`` cache along the sequence dim, at static bounds, into a
    cache that is a network input. Bounds are first clamped to the cache as
    Python slicing does (a negative bound counts from the end; an open end,
    written as ``2**63-1``, or a bound past the end stops at the dim's size),
    as Torch-TensorRT does before it aliases such a write; the
    engine then writes exactly the clamped slots. So, in order, a write is
    refused when it:

    1. carries the no-alias marker;
    2. is not a slice or index-copy write, is a full overwrite, has a runtime
       bound, or a dim that does not index the cache (:func:`resolve_bounds`);
    3. targets a cache that is not ``rank``-D, or writes a dim other than
       ``seq_dim``, or the cache has a runtime size;
    4. (slices) is strided, or writes no slot once clamped (``cache[:, :, 20:]``
       of 16 slots). TensorRT itself ignores the step and lands a strided write
       in consecutive slots; refusing it sends the write to copy-back, which is
       correct;
    5. (slices) writes a value whose length along the dim is not the number of
       slots the clamped bounds name. TensorRT's layer writes the value's own
       length from the start, and Torch-TensorRT aliases only when
       ``start + length <= size``: ``slice_scatter(cache, src, 2, -4, 20)`` on 16
       slots with an 8-slot ``src`` (start 12, 8 slots, 20 > 16) is not aliased
       there, so it is not here;
    6. reaches the engine other than as a direct input.
    """

    rank: int = 4
    seq_dim: int = 2

    def alias_refusal(self, write: EngineWrite) -> str | None:
        """``None`` when the layer aliases ``write``; otherwise the reason it does not."""
        if write.no_alias:
            return "it carries the no-alias marker (a copy-back write the engine must leave alone)"
        bounds = resolve_bounds(write)
        if bounds.status is not WriteStatus.OK:
            return _STATUS_REASONS[bounds.status].format(write=write.write.describe())
        if len(write.shape) != self.rank:
            return (
                f"the cache is {len(write.shape)}-D; the KV update takes a {self.rank}-D "
                "[batch, heads, seq, head_dim] cache"
            )
        if bounds.dim != self.seq_dim:
            return f"it writes dim {bounds.dim}, not the sequence dim {self.seq_dim}"
        if any(isinstance(s, Dynamic) for s in write.shape):
            return "the cache has a runtime size"
        if write.write.kind is WriteKind.SLICE_SCATTER:
            if bounds.step != 1:
                return f"it is strided (step {bounds.step}); the KV update writes consecutive slots"
            if not bounds.length:
                return f"it writes no slot once its bounds are clamped to the cache ({write.write.describe()})"
            written = write.source_shape[bounds.dim] if write.source_shape is not None else bounds.length
            if written != bounds.length:
                return (
                    f"its value has {written} slot(s) along dim {bounds.dim} but its bounds, clamped to the "
                    f"cache, name {bounds.length} from {bounds.start}; the KV update writes the value's own "
                    f"length from the start, past the slots eager PyTorch writes ({write.write.describe()})"
                )
        if not write.direct_input:
            return (
                "the cache does not reach the engine as a direct input: another node "
                "reads its old value, or it arrives through an op the lowering keeps"
            )
        return None
