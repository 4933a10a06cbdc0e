"""What a call of the MLX delegate does whichever path runs it (``writeback_mlx_backend.compiled_call``
or ``writeback_mlx_backend.interpreted``): inputs bound into MLX, copies and evaluations
counted, the memory a value points into compared (spans, snapshots), and the outputs
written into the runtime's memory (guarantee 4 of ``writeback_mlx_backend.mlx_delegate``)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from writeback_mlx_backend.allocations import lookup
from writeback_mlx_backend.handle import Handle
from writeback_mlx_backend.op_handler import Region

# How many of the latest input copies ``MLXDelegate.copied_input_bytes`` keeps.
COPY_HISTORY = 64


def span(value: Any) -> tuple[int, int] | None:
    """The byte range ``[lo, hi)`` an evaluated MLX array or a tensor points into."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return None
        lo = hi = value.data_ptr()
        for size, stride in zip(value.shape, value.stride(), strict=True):
            reach = (size - 1) * stride * value.element_size()
            lo, hi = min(lo, lo + reach), max(hi, hi + reach)
        return lo, hi + value.element_size()
    if not isinstance(value, mx.array) or value.size == 0:
        return None
    view = np.asarray(value)
    lo = hi = view.__array_interface__["data"][0]
    for size, stride in zip(view.shape, view.strides, strict=True):
        reach = (size - 1) * stride
        lo, hi = min(lo, lo + reach), max(hi, hi + reach)
    return lo, hi + view.itemsize


def overlaps(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    """Whether two byte ranges (``span``) share a byte."""
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def snapshot(value: Any) -> Any:
    """A copy of ``value`` in MLX memory of its own, evaluated."""
    copy = mx.array(value)
    mx.eval(copy)
    return copy


def apply(dest: np.ndarray, region: Region) -> None:
    """Store ``region`` into ``dest`` (added to it where the region accumulates)."""
    if region.accumulate:
        np.add.at(dest, region.key, region.values)
    else:
        dest[region.key] = region.values


def tensor_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``span`` of a tensor, quick for the contiguous case."""
    if tensor.is_contiguous():
        if tensor.numel() == 0:
            return None
        start = tensor.data_ptr()
        return start, start + tensor.numel() * tensor.element_size()
    return span(tensor)


def same_memory(a: Any, b: Any) -> bool:
    """Two tensors over the same bytes."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensor_span(a) == tensor_span(b)


def check_whole(handle: Handle, results: Sequence[Any], inputs: Sequence[Any]) -> None:
    """Before any output is written: each value written whole into an input has its shape."""
    for output, input_ in handle.whole:
        shape, expected = tuple(getattr(results[output], "shape", ())), tuple(inputs[input_].shape)
        if shape != expected:
            raise ValueError(
                f"MLX delegate output {output} has shape {shape}, but it replaces input "
                f"{handle.program.inputs[input_]} of shape {expected} in place; nothing was written"
            )


class Calls:
    """The delegate's counters over its calls, and what each call does with them."""

    def __init__(self) -> None:
        # Bytes copied into MLX to bind inputs that MLX did not own: the total over
        # all calls (what ``writeback run`` reports) and the last few copies, one
        # entry each (bounded: a long decode loop must not grow it), for tests.
        self.copied_input_bytes_total = 0
        self.copied_input_bytes: deque[int] = deque(maxlen=COPY_HISTORY)
        # Evaluations of MLX graphs over all calls: explicit ones, and host reads of a
        # value mid-graph (an in-place write's region on the interpreted path).
        self.evaluations_total = 0
        # How each handle initialized since the delegate was made runs (see ``MLXDelegate.path``),
        # the latest few: what ``writeback run`` reports as the delegate's execution.
        self.execution_paths: deque[str] = deque(maxlen=COPY_HISTORY)
        # For each of the latest calls of a program with an attention window, how many
        # positions its attention read (see ``writeback_mlx_backend.window``).
        self.attention_lengths: deque[int] = deque(maxlen=COPY_HISTORY)
        # Calls a window would have bounded that ran over the whole axis because a removed
        # row was not known finite, and scans of callers' tensors past the bounded length.
        self.exact_calls = 0
        self.finite_scans = 0

    def _evaluate(self, *arrays: Any) -> None:
        self.evaluations_total += 1
        mx.eval(*arrays)

    def _bind(self, value: Any, copies: list[int] | None = None) -> tuple[Any, bool]:
        """An input as MLX: the caller's MLX array (shared) or a copy (not shared). A copy's
        size is counted, or added to ``copies`` for the caller to count."""
        if not isinstance(value, torch.Tensor):
            return value, False
        found = lookup(value)
        if found is not None:
            return found, True
        nbytes = value.numel() * value.element_size()
        if copies is None:
            self._count_copy(nbytes)
        else:
            copies.append(nbytes)
        host = (
            value.numpy() if value.is_contiguous() and not value.requires_grad else value.detach().contiguous().numpy()
        )
        return mx.array(host), False

    def _count_copy(self, nbytes: int) -> None:
        self.copied_input_bytes_total += nbytes
        self.copied_input_bytes.append(nbytes)

    def _write_outputs(
        self,
        results: list[Any],
        outputs: list[Any],
        done: set[int],
        maybe_shared: bool,
    ) -> None:
        if maybe_shared:
            self._snapshot_overlapping(results, outputs, done)
            pending = [i for i in range(len(outputs)) if i not in done]
        else:
            pending = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and i not in done]
        for index in pending:
            tensor = outputs[index]
            source = np.asarray(results[index])
            if source.shape != tensor.shape:
                if math.prod(source.shape) != tensor.numel():
                    raise ValueError(
                        f"MLX delegate output {index} has shape {source.shape}, the runtime "
                        f"allocated {tuple(tensor.shape)}"
                    )
                source = source.reshape(tuple(tensor.shape))
            np.copyto(tensor.numpy(), source, casting="unsafe")

    @staticmethod
    def _snapshot_overlapping(results: list[Any], outputs: list[Any], done: set[int]) -> None:
        """Mark outputs already in their destination as done; copy results another output would clobber."""
        spans = [span(t) if isinstance(t, torch.Tensor) else None for t in outputs]
        pending = []
        for index, (value, tensor) in enumerate(zip(results, outputs, strict=True)):
            if not isinstance(tensor, torch.Tensor) or index in done:
                done.add(index)
                continue
            if isinstance(value, mx.array) and span(value) == spans[index]:
                done.add(index)  # already in the destination's memory
                continue
            pending.append(index)
        targets = [spans[i] for i in pending]
        for index, value in enumerate(results):
            if isinstance(value, mx.array) and any(
                overlaps(span(value), t) for j, t in zip(pending, targets, strict=True) if j != index
            ):
                results[index] = snapshot(value)
