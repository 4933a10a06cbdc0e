"""Sizes as every package prints them."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: int | None) -> str:
    """``2.0 KiB``-style sizes; ``?`` when unknown."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
