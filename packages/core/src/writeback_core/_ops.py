"""Kept importable for code written against the private name: use :mod:`writeback_core.ops`."""

from __future__ import annotations

from writeback_core.ops import aten_op, is_aten, op_name, packet_name, schema_of

__all__ = ["aten_op", "is_aten", "op_name", "packet_name", "schema_of"]
