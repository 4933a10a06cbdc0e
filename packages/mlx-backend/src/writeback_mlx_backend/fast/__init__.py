"""Chains of aten steps run as one ``mx.fast`` kernel each, one module per fusion.

- :mod:`writeback_mlx_backend.fast.rms_norm`: RMSNorm as ``mx.fast.rms_norm``
  (:func:`~writeback_mlx_backend.fast.rms_norm.fuse_rms_norms`);
- :mod:`writeback_mlx_backend.fast.sdpa`: attention as
  ``mx.fast.scaled_dot_product_attention`` in place of the steps PyTorch exports for it
  (:func:`~writeback_mlx_backend.fast.sdpa.fuse_attention`);
- :mod:`writeback_mlx_backend.fast.rope`: rotary embeddings in Hugging Face's form as
  ``mx.fast.rope`` (:func:`~writeback_mlx_backend.fast.rope.fuse_ropes`).

What they share (references, traced shapes and dtypes, replacing a matched chain) is in
``writeback_mlx_backend.fast._chains``.

Only steps decoded from the delegate's own blob are matched, and the fused steps are
made here, never named by the blob: nothing read from a file chooses them.
"""

from __future__ import annotations
