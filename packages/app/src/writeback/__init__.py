"""``python -m writeback``: the ``writeback`` command line (the library is ``writeback_core``).

Its public names are the modules' own (``writeback.cli``, ``writeback.session``, ...) and,
here, how the commands write a file whole or not at all, for the commands plugins add.
"""

from __future__ import annotations

from writeback._files import WriteFailed, replacing

__all__ = ["WriteFailed", "replacing"]
