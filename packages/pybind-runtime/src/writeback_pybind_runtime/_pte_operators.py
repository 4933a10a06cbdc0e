"""What the operators a ``.pte`` plan calls take and write, from torch's schemas.

This module holds what the plan checks and the written-input analysis ask of an operator
named in the file: :func:`kernel_signature` (the types of a kernel call's arguments: the
schema's arguments, then what ExecuTorch's emitter appends), :func:`accepted_kinds` (the value
kinds such a type accepts), :func:`written_positions` (which kernel-call arguments the operator
writes) and :data:`VIEW_OPERATORS`. The names come from the file, so a schema is looked up by
name in torch's operator registry, never through attribute access.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from writeback_pybind_runtime._pte_format import (
    BOOL,
    BOOL_LIST,
    DOUBLE,
    DOUBLE_LIST,
    INT,
    INT_LIST,
    NULL,
    OPTIONAL_TENSOR_LIST,
    STRING,
    TENSOR,
    TENSOR_LIST,
)

__all__ = ["VIEW_OPERATORS", "accepted_kinds", "kernel_signature", "written_positions"]

# What value kinds a schema argument type accepts, keyed by the type as torch prints it.
_ACCEPTS: dict[str, frozenset[int]] = {
    "Tensor": frozenset({TENSOR}),
    "number": frozenset({INT, DOUBLE, BOOL}),
    "int": frozenset({INT}),
    "SymInt": frozenset({INT}),
    "float": frozenset({DOUBLE}),
    "bool": frozenset({BOOL}),
    "str": frozenset({STRING}),
    "ScalarType": frozenset({INT}),
    "Layout": frozenset({INT}),
    "MemoryFormat": frozenset({INT}),
    "List[int]": frozenset({INT_LIST}),
    "List[SymInt]": frozenset({INT_LIST}),
    "List[float]": frozenset({DOUBLE_LIST}),
    "List[bool]": frozenset({BOOL_LIST}),
    "List[Tensor]": frozenset({TENSOR_LIST}),
    "List[Optional[Tensor]]": frozenset({OPTIONAL_TENSOR_LIST}),
}


def accepted_kinds(type_name: str) -> frozenset[int] | None:
    """Value kinds a schema type accepts, or ``None`` for a type not checked."""
    if type_name.startswith("Optional[") and type_name.endswith("]"):
        inner = accepted_kinds(type_name[len("Optional[") : -1])
        return None if inner is None else inner | {NULL}
    return _ACCEPTS.get(type_name)


@cache
def _schema(name: str, overload: str) -> Any:
    """torch's ``FunctionSchema`` of operator ``name.overload``, or ``None`` when torch
    does not know it."""
    import torch

    # Looked up by name in torch's operator registry: the names come from the file,
    # so they never reach attribute access (a getattr chain on ``torch.ops`` can walk
    # to ``torch.ops.import_module`` and beyond).
    try:
        return torch._C._get_schema(name, "" if overload in ("", "default") else overload)
    except RuntimeError:
        return None


def _trailing(schema: Any) -> tuple[str, ...]:
    """The types of what ExecuTorch's emitter appends to a kernel call after the schema's
    arguments: for an out variant, its out arguments again (the one out argument, or
    several as one list; ``split_with_sizes_copy.out`` returns nothing yet gets its out
    list appended); otherwise its returns (several as one list: ``max.dim_max``)."""
    out = [a for a in schema.arguments if a.is_out]
    if out:
        return (str(out[0].type),) if len(out) == 1 else ("List[Tensor]",)
    returns = tuple(str(r.type) for r in schema.returns)
    return ("List[Tensor]",) if len(returns) > 1 else returns


# Operators of ExecuTorch's own that torch has no schema for, with the kinds of their
# kernel-call arguments: a view's kernel reads its size as an IntList (an Int there
# aborts the process in toIntList()).
_PRIM_SIGNATURES: dict[tuple[str, str], tuple[str, ...]] = {
    ("executorch_prim::et_view", "default"): ("Tensor", "List[int]", "Tensor"),
}


@cache
def kernel_signature(name: str, overload: str) -> tuple[str, ...] | None:
    """The types of a kernel call's arguments to operator ``name.overload``: the schema's
    arguments, then :func:`_trailing`; ``None`` when neither torch nor
    :data:`_PRIM_SIGNATURES` knows the operator (then only index ranges are checked)."""
    if (name, overload) in _PRIM_SIGNATURES:
        return _PRIM_SIGNATURES[name, overload]
    schema = _schema(name, overload)
    if schema is None:
        return None
    return tuple(str(a.type) for a in schema.arguments) + _trailing(schema)


@cache
def written_positions(name: str, overload: str) -> frozenset[int] | None:
    """Which kernel-call arguments operator ``name.overload`` writes: those its schema
    marks written (``Tensor(a!)``, ``Tensor(a!)[]``) and what :func:`_trailing` appends
    (for an out variant the out arguments again; otherwise the returns, except one that
    aliases an argument without writing it). ``None`` when torch does not know the
    operator."""
    schema = _schema(name, overload)
    if schema is None:
        return None
    n = len(schema.arguments)
    written = {k for k, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    if any(a.is_out for a in schema.arguments) or len(schema.returns) > 1:
        written.add(n)  # the out arguments again, or one list of the returns (the out arguments)
        return frozenset(written)
    for r, returned in enumerate(schema.returns):
        if returned.alias_info is None or returned.alias_info.is_write:
            written.add(n + r)
    return frozenset(written)


VIEW_OPERATORS = frozenset({"executorch_prim::et_view"})
