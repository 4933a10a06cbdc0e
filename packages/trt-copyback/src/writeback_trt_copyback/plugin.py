"""Entry-point plugin of writeback-trt-copyback (thin: imports core and torch only)."""

from __future__ import annotations

writeback_name = "trt-copyback"
