"""The backend names the passes of this package serve, which each pass lists in its
``ProgramPass.backends`` (a module of its own: the passes and the entry-point plugin both read
it, and neither imports the other for it)."""

from __future__ import annotations

from writeback_core import NO_BACKEND

__all__ = ["KERNEL_BACKENDS", "PORTABLE", "STOCK_RUNTIME", "XNNPACK", "XNNPACK_BACKEND_ID"]

PORTABLE = "portable"
XNNPACK = "xnnpack"
# The id ExecuTorch's XNNPACK delegate registers under (``LoweredBackendModule.backend_id``).
XNNPACK_BACKEND_ID = "XnnpackBackend"
# The backends whose state writes run on the stock runtime's kernels, made in place here.
KERNEL_BACKENDS = (PORTABLE, XNNPACK)
# The lowerings whose programs run on the stock runtime's kernels (a lowering with no backend
# too): the passes that rewrite a graph for those kernels serve these and no delegate's
# backend (MLX's delegate writes state, checks indices, bounds and scales attention itself).
STOCK_RUNTIME = frozenset({PORTABLE, XNNPACK, NO_BACKEND})
