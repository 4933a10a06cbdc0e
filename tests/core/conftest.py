from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from executorch.exir import EdgeProgramManager, to_edge
from torch.export import ExportedProgram


def _export(module: torch.nn.Module, args: tuple[object, ...]) -> ExportedProgram:
    module = module.eval().requires_grad_(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(module, args, strict=False)


@pytest.fixture
def export() -> Callable[[torch.nn.Module, tuple[object, ...]], ExportedProgram]:
    """torch.export (non-strict, no grad) a module on example args."""
    return _export


@pytest.fixture
def aten() -> Callable[[torch.nn.Module, tuple[object, ...]], ExportedProgram]:
    """The decomposed aten program of a module."""

    def make(module: torch.nn.Module, args: tuple[object, ...]) -> ExportedProgram:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return _export(module, args).run_decompositions()

    return make


@pytest.fixture
def edge() -> Callable[[torch.nn.Module, tuple[object, ...]], EdgeProgramManager]:
    """The edge program manager of a module."""

    def make(module: torch.nn.Module, args: tuple[object, ...]) -> EdgeProgramManager:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return to_edge(_export(module, args))

    return make
