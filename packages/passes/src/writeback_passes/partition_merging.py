"""exir's ``GroupBasedPartitioner`` (the one XNNPACK's partitioner proposes its partitions with)
with its merge check answered from set intersections (:func:`merge_checked_by_sets`).

The partitioner starts from one partition per supported node and tries to merge every pair.
Before each merge it checks that the merged partition makes no cycle: no node outside both
partitions that uses one of their nodes may lead back into them. It reads that off the
transitive downstream set of each such outside user, which it precomputes, but walks the set
node by node in Python, asking of each node whether it is in the pair. On a 0.5B decoder
(about 2,000 nodes, downstream sets of up to as many) that walk is about 5% of
``writeback export``'s time.

:func:`merge_checked_by_sets`, entered by the ``xnnpack`` backend's ``lowering_context``,
answers the same question, pair by pair, with the same data:

1. the nodes of both partitions, and their users outside them;
2. a cycle when the downstream set of one of those users meets the merged nodes (a set
   intersection, in C);
3. then the partitioner's own last check, torch's ``validate_partition`` on the merged nodes.

The answer for every pair is the one the partitioner gives, so the partitions, the delegates
and the ``.pte`` are the same byte for byte (tests/passes/test_partition_merging.py compares
them). Refused: answering from anything but the partitioner's own downstream sets (a cache
that outlives a merge would go stale).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["merge_checked_by_sets"]


def _merges_without_cycle(self: Any, first: int, second: int, partitions_by_id: dict[int, Any]) -> bool:
    """Whether merging partitions ``first`` and ``second`` makes no cycle (steps 1 to 3)."""
    from torch.fx.passes.utils.fuser_utils import validate_partition

    merged: set[torch.fx.Node] = set(partitions_by_id[first].nodes) | set(partitions_by_id[second].nodes)
    outside = {user for node in merged for user in node.users if user not in merged}
    downstreams = self.dependency_viewer.downstreams_of
    if any(not downstreams(user).isdisjoint(merged) for user in outside):
        return False
    return bool(validate_partition(list(merged)))


@contextmanager
def merge_checked_by_sets() -> Iterator[None]:
    """While the block runs, exir's ``GroupBasedPartitioner`` checks a merge with set
    intersections (see the module docstring). Process-wide while the block runs. An exir
    whose partitioner has no such check (or no dependency viewer) partitions as it does."""
    from executorch.exir.backend.canonical_partitioners import group_partitioner

    partitioner = group_partitioner.GroupBasedPartitioner
    original = partitioner.__dict__.get("_can_merge_partitions")
    if original is None or not hasattr(group_partitioner, "_DependencyViewer"):
        yield
        return
    setattr(partitioner, "_can_merge_partitions", _merges_without_cycle)  # noqa: B010
    try:
        yield
    finally:
        setattr(partitioner, "_can_merge_partitions", original)  # noqa: B010
