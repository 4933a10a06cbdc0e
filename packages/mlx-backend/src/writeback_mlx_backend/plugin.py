"""Entry-point plugin of writeback-mlx-backend (thin: imports core and torch only)."""

from __future__ import annotations

writeback_name = "mlx-backend"
