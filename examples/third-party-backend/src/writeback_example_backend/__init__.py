"""An example third-party writeback backend (``example``): in-place index_copy cache writes."""

from __future__ import annotations

__all__ = ["BACKEND_ID", "BACKEND_NAME"]

BACKEND_NAME = "example"
BACKEND_ID = "WritebackExampleBackend"
