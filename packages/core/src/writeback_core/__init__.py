"""writeback-core: the mutation model, alias analysis, plugin registry and CLI of writeback."""

from __future__ import annotations

from writeback_core._name import NAME
from writeback_core.alias import AliasAnalysis
from writeback_core.mutations import (
    Dynamic,
    Mutation,
    MutationKind,
    WriteKind,
    WriteShape,
    classify_write,
    find_mutations,
)
from writeback_core.registry import (
    InPlaceConflictError,
    InPlaceDecision,
    Registry,
    hookimpl,
    in_place_decisions,
    load_registry,
)
from writeback_core.types import BackendSpec, PartitionView, ProgramPass, RuntimeDelegate, Stage
from writeback_core.zoo import ModelCase, builtin_models

__all__ = [
    "NAME",
    "AliasAnalysis",
    "BackendSpec",
    "Dynamic",
    "InPlaceConflictError",
    "InPlaceDecision",
    "ModelCase",
    "Mutation",
    "MutationKind",
    "PartitionView",
    "ProgramPass",
    "Registry",
    "RuntimeDelegate",
    "Stage",
    "WriteKind",
    "WriteShape",
    "builtin_models",
    "classify_write",
    "find_mutations",
    "hookimpl",
    "in_place_decisions",
    "load_registry",
]
