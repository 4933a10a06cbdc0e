"""The ``scale_smaller_operand`` pass: each scalar multiply of a matmul operand moved to the
smaller operand, on the stock runtime's lowerings.

The rewrite itself (its steps, and what it refuses) is
:func:`writeback_core.matmul_scaling.scale_smaller_operand`, which writeback-mlx-backend also
runs on the graph its delegate takes; this module makes it a ``"before_partition"`` pass.
"""

from __future__ import annotations

from writeback_core import ProgramPass
from writeback_core.matmul_scaling import scale_smaller_operand

__all__ = ["scale_smaller_operand_pass"]


def scale_smaller_operand_pass() -> ProgramPass:
    """:func:`~writeback_core.matmul_scaling.scale_smaller_operand` as a ``"before_partition"``
    :class:`~writeback_core.ProgramPass` (after the reshape copies are made views, which leaves
    the multiply next to its matmul), for the stock runtime's lowerings: MLX's delegate moves
    the scale itself, in its own ``preprocess``."""
    from writeback_passes.backend_names import STOCK_RUNTIME

    return ProgramPass(
        name="scale_smaller_operand",
        stage="before_partition",
        run=scale_smaller_operand,
        after=("functional_copies_as_views",),
        backends=STOCK_RUNTIME,
        reason="attention scaled on its smaller operand",
    )
