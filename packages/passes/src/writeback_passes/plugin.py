"""Entry-point plugin of writeback-passes (thin: imports core and torch only)."""

from __future__ import annotations

writeback_name = "passes"
