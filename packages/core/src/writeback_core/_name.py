"""The project's one name: pluggy project, entry-point group, CLI and marker prefix."""

from __future__ import annotations

NAME = "writeback"
