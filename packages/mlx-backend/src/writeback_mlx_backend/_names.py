"""Names of the MLX backend (no MLX import: the plugin module reads these)."""

from __future__ import annotations

# What users pick (``--backend mlx``) and what decisions record.
BACKEND_NAME = "mlx"
# The ExecuTorch backend id: the ``BackendDetails`` subclass name in delegate blobs.
BACKEND_ID = "WritebackMLXBackend"
