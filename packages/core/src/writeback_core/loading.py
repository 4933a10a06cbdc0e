"""Resolve a model argument: a built-in name, or ``path/to/file.py:factory``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from writeback_core.zoo import ModelCase

__all__ = ["resolve_model"]


def _from_file(spec: str) -> ModelCase:
    path_text, _, factory_name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"model {spec!r}: no file {path_text!r}; use path/to/file.py:factory")
    module_name = f"_writeback_user_{path.stem}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ValueError(f"model {spec!r}: cannot import {path_text!r} as Python")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    loader.loader.exec_module(module)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {path_text!r} has no callable {factory_name!r}")
    made: Any = factory()
    if isinstance(made, ModelCase):
        return made
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module) and isinstance(made[1], tuple):
        module_obj, args = made
        return ModelCase(
            name=spec,
            description=f"{factory_name} from {path.name}",
            build=lambda: module_obj,
            step_inputs=lambda step: tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args),
        )
    raise ValueError(
        f"model {spec!r}: {factory_name}() returned {type(made).__name__}; return a "
        "writeback_core.zoo.ModelCase or a tuple (nn.Module, example_args)"
    )


def resolve_model(name: str, models: dict[str, ModelCase]) -> ModelCase:
    """Look ``name`` up among ``models`` (built-in and plugins'), or load ``file.py:factory``."""
    if name in models:
        return models[name]
    if ":" in name and name.rpartition(":")[0].endswith(".py"):
        return _from_file(name)
    raise ValueError(
        f"unknown model {name!r}; built-in models: {', '.join(sorted(models))}; or pass path/to/file.py:factory"
    )
