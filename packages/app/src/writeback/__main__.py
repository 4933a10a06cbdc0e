"""``python -m writeback``, the same command as the ``writeback`` console script."""

from __future__ import annotations

from writeback_core import NAME

from writeback.cli import main

if __name__ == "__main__":
    # The program name the console script shows, so help and errors read the same.
    main(prog_name=NAME)
