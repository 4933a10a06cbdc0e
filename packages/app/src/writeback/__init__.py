"""``python -m writeback``: the ``writeback`` command line (the library is ``writeback_core``)."""

from __future__ import annotations
