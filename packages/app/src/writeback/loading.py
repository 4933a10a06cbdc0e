"""Resolve a model argument: a built-in name, or ``path/to/file.py:factory``.

Code in a model file is the user's: when it raises (on import, in the factory,
or later, in ``forward`` while exporting), :func:`user_code_error` says where in
that file, so the CLI can print one paragraph instead of a traceback through
importlib and click.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from writeback_core import NAME
from writeback_core.types import ModelCase

__all__ = ["TRACEBACK_ENV", "ModelCodeError", "resolve_model", "user_code_error"]

# Set (to anything but empty) to see the whole traceback of an error in a model file.
TRACEBACK_ENV = f"{NAME.upper()}_TRACEBACK"

# Model files are imported under this module-name prefix; a frame whose globals carry
# it runs the user's code (see ``user_code_error``).
_USER_MODULE_PREFIX = f"_{NAME}_user_"

# A message longer than this is cut: torch's errors can run to pages.
_MESSAGE_CHARS = 300


class ModelCodeError(ValueError):
    """Code in a model file raised while it was imported or its factory ran.

    The message names the file and line where it was raised (see
    :func:`user_code_error`); ``__cause__`` is the error itself.
    """


def _innermost_user_frame(trace: TracebackType | None) -> tuple[str, int, str] | None:
    found = None
    while trace is not None:
        frame = trace.tb_frame
        if str(frame.f_globals.get("__name__", "")).startswith(_USER_MODULE_PREFIX):
            found = (frame.f_code.co_filename, trace.tb_lineno, frame.f_code.co_name)
        trace = trace.tb_next
    return found


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it is inside it (as the user typed it)."""
    path = os.path.normpath(path)
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if relative.startswith(os.pardir) else relative


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def user_code_error(error: BaseException) -> str | None:
    """Where a model file raised ``error``, or ``None`` when no model file's code is involved.

    A ``SyntaxError`` gives its own file and line; any other error the innermost
    frame of its traceback that runs in a model file, with the error's type and
    the first line of its message: ``KeyError: 'x' (f.py, line 4, in helper)``, the
    path relative to the working directory when inside it.
    An error without such a frame is looked for in its ``__cause__`` / ``__context__``
    chain (a library that wrapped the user's error).
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, SyntaxError) and current.filename:
            where = f"{_shown(current.filename)}, line {current.lineno}"
            return f"{where} is not valid Python: {current.msg}"
        frame = _innermost_user_frame(current.__traceback__)
        if frame is not None:
            path, line, function = frame
            return f"{_first_line(current)} ({_shown(path)}, line {line}, in {function})"
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return None


def _code_error(spec: str, doing: str, error: Exception) -> ModelCodeError:
    where = user_code_error(error)
    if where is None:  # raised outside the file (e.g. by a library it imports): name the file anyway
        where = f"{_first_line(error)} (raised outside {spec.rpartition(':')[0]})"
    return ModelCodeError(
        f"model {spec!r}: {doing} raised {where}. Fix it there ({TRACEBACK_ENV}=1 shows the traceback)."
    )


def _from_file(spec: str) -> ModelCase:
    path_text, _, factory_name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"model {spec!r}: no file {path_text!r}; use path/to/file.py:factory")
    module_name = f"{_USER_MODULE_PREFIX}{path.stem}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ValueError(f"model {spec!r}: cannot import {path_text!r} as Python")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        if isinstance(error, SyntaxError) and error.filename:
            raise ModelCodeError(
                f"model {spec!r}: {user_code_error(error)}. Fix it there ({TRACEBACK_ENV}=1 shows the traceback)."
            ) from error
        raise _code_error(spec, f"importing {path_text}", error) from error
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        defined = sorted(
            name
            for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module_name and not name.startswith("_")
        )
        raise ValueError(
            f"model {spec!r}: {path_text!r} has no callable {factory_name!r}; "
            f"functions defined there: {', '.join(defined) or 'none'}"
        )
    try:
        made: Any = factory()
    except Exception as error:
        raise _code_error(spec, f"{factory_name}()", error) from error
    if isinstance(made, ModelCase):
        return made
    fixed = _fixed_inputs(made)
    if fixed is None:
        raise ValueError(
            f"model {spec!r}: {factory_name}() returned {_shape_of(made)}; return a "
            "writeback_core.types.ModelCase (how to give each step its own inputs, keyword arguments, "
            "strict export or an ExportedProgram), or a tuple (nn.Module, args) or (nn.Module, args, kwargs) "
            "whose inputs every step reuses"
        )
    module_obj, args, kwargs = fixed
    return ModelCase(
        name=spec,
        description=f"{factory_name} from {path.name}",
        build=lambda: module_obj,
        step_inputs=lambda step: _cloned(args),
        step_kwargs=lambda step: _cloned(kwargs),
        same_inputs_every_step=True,
    )


def _shape_of(made: Any) -> str:
    if isinstance(made, tuple):
        return "a tuple (" + ", ".join(type(item).__name__ for item in made) + ")"
    return type(made).__name__


def _fixed_inputs(made: Any) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None:
    """``(module, args)`` or ``(module, args, kwargs)`` as its three parts; ``None`` for anything else."""
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], nn.Module):
        return None
    args = made[1]
    kwargs = made[2] if len(made) == 3 else {}
    if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        return None
    return made[0], args, kwargs


def _cloned(value: Any) -> Any:
    """``value`` with every tensor in it cloned, so that no step sees another step's writes."""
    return pytree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, value)


def resolve_model(name: str, models: dict[str, ModelCase]) -> ModelCase:
    """Look ``name`` up among ``models`` (built-in and plugins'), or load ``file.py:factory``.

    :raises ModelCodeError: the file raised on import or its factory raised (a ``ValueError``).
    :raises ValueError: no such model, file or factory, or the factory returned something else.
    """
    if name in models:
        return models[name]
    if ":" in name and name.rpartition(":")[0].endswith(".py"):
        return _from_file(name)
    raise ValueError(
        f"unknown model {name!r}; built-in models: {', '.join(sorted(models))}; or pass path/to/file.py:factory"
    )
