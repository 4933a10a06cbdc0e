"""The exceptions this runtime raises besides ``ValueError``/``TypeError``/``RuntimeError``."""

from __future__ import annotations

__all__ = ["DelegateError", "ProgramError"]


class DelegateError(RuntimeError):
    """A Python delegate raised while the runtime called it.

    The delegate's own exception is ``__cause__``; the message names the
    method, the backend id and the original error.
    """


class ProgramError(ValueError):
    """A program or one of its methods could not be loaded (corrupted, truncated,
    missing operators or backends); the message carries ExecuTorch's error code."""
