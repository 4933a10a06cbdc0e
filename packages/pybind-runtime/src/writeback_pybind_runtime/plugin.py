"""Entry-point plugin of writeback-pybind-runtime (thin: imports core and torch only)."""

from __future__ import annotations

writeback_name = "pybind-runtime"
