"""writeback-core: the contract of writeback: the mutation model, alias analysis, hookspecs,
plugin registry and the types that cross package lines. The ``writeback`` command is the
application's (the ``writeback`` distribution).

The partition wrapper (:mod:`writeback_core.partition`) needs ExecuTorch's exir,
so its names are imported on first use: ``import writeback_core`` (and every
thin entry-point plugin) never imports exir.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from writeback_core._name import NAME
from writeback_core.alias import AliasAnalysis
from writeback_core.blob import InPlaceOutput, encode_in_place_outputs, in_place_outputs
from writeback_core.copies import CopyLeft, CopyLeftWarning, copies_left
from writeback_core.mutations import (
    Dynamic,
    Mutation,
    MutationKind,
    WriteKind,
    WriteShape,
    classify_write,
    find_mutations,
)
from writeback_core.pass_order import PassOrderError
from writeback_core.registry import (
    InPlaceConflictError,
    InPlaceDecision,
    Registry,
    hookimpl,
    in_place_decisions,
    load_registry,
)
from writeback_core.types import NO_BACKEND, BackendSpec, ModelCase, PartitionView, ProgramPass, RuntimeDelegate, Stage

if TYPE_CHECKING:
    from writeback_core.partition import (
        AnnotatingPartitioner,
        annotating,
        record_in_place_decisions,
        to_edge_arguments,
    )

__all__ = [
    "NAME",
    "NO_BACKEND",
    "AliasAnalysis",
    "AnnotatingPartitioner",
    "BackendSpec",
    "CopyLeft",
    "CopyLeftWarning",
    "Dynamic",
    "InPlaceConflictError",
    "InPlaceDecision",
    "InPlaceOutput",
    "ModelCase",
    "Mutation",
    "MutationKind",
    "PartitionView",
    "PassOrderError",
    "ProgramPass",
    "Registry",
    "RuntimeDelegate",
    "Stage",
    "WriteKind",
    "WriteShape",
    "annotating",
    "classify_write",
    "copies_left",
    "encode_in_place_outputs",
    "find_mutations",
    "hookimpl",
    "in_place_decisions",
    "in_place_outputs",
    "load_registry",
    "record_in_place_decisions",
    "to_edge_arguments",
]

_LAZY = {
    "AnnotatingPartitioner": "writeback_core.partition",
    "annotating": "writeback_core.partition",
    "record_in_place_decisions": "writeback_core.partition",
    "to_edge_arguments": "writeback_core.partition",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'writeback_core' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
