"""Building and exporting a :class:`~writeback_core.types.ModelCase`: the model's own code
runs here (its ``build()``), and its errors are reported as the model's, not a lowering's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.export import ExportedProgram
from writeback_core.core_aten import check_core_aten
from writeback_core.exporting import check_lifted_state, export_model

if TYPE_CHECKING:
    from writeback_core.types import ModelCase

__all__ = ["ModelBuildError", "build_case_module", "export_case"]


class ModelBuildError(ValueError):
    """Building the model (a case's ``build()``: the user's class, a library's model) raised.

    Not a lowering failure: nothing was exported. ``model`` names the model; the message
    names it and the error; ``__cause__`` is the error itself.
    """

    def __init__(self, model: str, problem: str) -> None:
        super().__init__(
            f"model {model!r}: building the model {problem}. Nothing was exported; fix the model's code "
            "or configuration (its build() / __init__)"
        )
        self.model = model


def build_case_module(case: ModelCase) -> torch.nn.Module:
    """``case.build()``, its errors as :class:`ModelBuildError` naming the model and the error.

    :raises ModelBuildError: ``build()`` raised, or returned something else than an ``nn.Module``.
    """
    try:
        module = case.build()
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        raise ModelBuildError(case.name, f"raised {first[:300]}") from error
    if not isinstance(module, torch.nn.Module):
        raise ModelBuildError(case.name, f"returned {type(module).__name__}, not a torch.nn.Module")
    return module


def export_case(case: ModelCase) -> ExportedProgram:
    """Export a :class:`~writeback_core.types.ModelCase` as the case says: the program its
    ``exported`` returns when it gives one, else :func:`export_model` of a fresh module on
    the step-0 inputs (``example_args(0)``, ``example_kwargs(0)``) with the case's
    ``strict`` and ``dynamic_shapes``. Every command exports a case through this.

    :raises LoweringError: the program holds state as lifted constants (see
        :func:`check_lifted_state`), or an op outside Core ATen
        (:class:`~writeback_core.core_aten.OpsOutsideCoreAtenError`).
    :raises TypeError: ``exported`` returned something else than an ``ExportedProgram``.
    :raises ModelBuildError: building the model raised (:func:`build_case_module`).
    """
    what = f"model {case.name!r}"
    if case.exported is not None:
        program = case.exported()
        if not isinstance(program, ExportedProgram):
            raise TypeError(
                f"{what}: its exported() returned {type(program).__name__}; it must return the "
                "torch.export.ExportedProgram of the model (or leave exported unset to let writeback export it)"
            )
        check_lifted_state(program, None, what, None)
        check_core_aten(program, what)
        return program
    return export_model(
        build_case_module(case),
        case.example_args(0),
        case.example_kwargs(0),
        strict=case.strict,
        dynamic_shapes=case.dynamic_shapes,
        name=what,
    )
