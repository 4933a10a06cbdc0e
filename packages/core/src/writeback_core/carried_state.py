"""State the eager model carries from call to call, and the refusal of a program that drops it.

A model's state is whatever tensor its ``forward`` leaves changed for the next call: a
registered buffer written in place, but also a tensor held by a cache object or any other
attribute reachable from the module, written in place or rebound. ``torch.export`` keeps
only the first kind as state (``buffers_to_mutate``); a tensor a cache object allocates on
the first call, or a plain attribute rebound by ``forward``, becomes a temporary or a
constant of the program, which then starts every call from the first call's values and
answers wrongly from the second call on, without any error. :func:`carried_states` finds
the eager model's state, :func:`check_state_kept` refuses a program that drops any of it.

Algorithm of :func:`carried_states`:

1. Copy the module, sharing its parameters (weights are never state here): the user's
   module, its buffers and cache objects are left exactly as they were. A module that
   cannot be copied is called itself, and every table and tensor value step 2 walks
   through is put back afterwards.
2. List every tensor reachable from the copy: each submodule's buffers, then every
   attribute of each submodule, walked through lists, tuples, dicts and plain objects
   (a cache and its layers), never into parameters, torch's own objects or fake tensors.
3. Call the copy twice at the example inputs (cloned: the caller's inputs are not
   written), under ``no_grad``, listing the tensors after each call.
4. A tensor that a call rebinds (another object at the same place, or one that was not
   there) or writes in place (its version counter moved) is carried state; each is
   reported once per storage, under the name of a registered buffer sharing it if any.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from writeback_core.ops import written_placeholders
from writeback_core.types import LoweringError

__all__ = ["CarriedState", "StateLostError", "carried_states", "check_state_kept", "mutated_buffers"]

# The attributes every nn.Module has (its tables and hooks): not the model's own.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
# How deep the walk goes below a module's attribute, and how many objects it visits at most.
_DEPTH = 8
_MAX_OBJECTS = 100_000
# Objects of these top-level packages are not looked inside.
_NOT_WALKED = frozenset({"torch", "builtins", "typing", "enum", "functools", "weakref", "abc"})
# Errors list at most this many states by name.
_NAMED_AT_MOST = 6


class StateLostError(LoweringError):
    """The exported program drops state the eager model carries from call to call.

    ``states`` are the dropped :class:`CarriedState`; ``kept`` the program's mutated buffers.
    """

    def __init__(self, message: str, states: list[CarriedState], kept: list[str]) -> None:
        super().__init__(message, upstream=True)
        self.states = states
        self.kept = kept


@dataclass(frozen=True)
class CarriedState:
    """One tensor the eager module leaves changed for its next call.

    ``path``: where it is reached from the module (``cache.layers[0].keys``, or a registered
    buffer's name); ``buffers``: the registered buffers that share its storage (empty: it is
    no buffer); ``change``: how the two calls changed it, in words.
    """

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    change: str
    buffers: tuple[str, ...]

    def describe(self) -> str:
        """``cache.keys [1, 2, 16, 16] float32 (created by call 1, written in place by call 2; not a buffer)``."""
        dtype = str(self.dtype).removeprefix("torch.")
        where = f"registered buffer {', '.join(self.buffers)}" if self.buffers else "not a buffer"
        return f"{self.path} {list(self.shape)} {dtype} ({self.change}; {where})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _walkable(value: Any) -> bool:
    """Whether the walk looks inside ``value``'s attributes: a plain object (a cache, its
    layers), not a class, a function or module object (their type is a builtin) or one of
    torch's own objects (a graph, a fake-tensor mode)."""
    if isinstance(value, (type, types.ModuleType)):
        return False
    return hasattr(value, "__dict__") and type(value).__module__.split(".")[0] not in _NOT_WALKED


class _Reachable:
    """Every tensor reachable from a module, by path (see the module's algorithm, step 2)."""

    def __init__(self, module: nn.Module) -> None:
        self.found: dict[str, torch.Tensor] = {}
        self.tables: list[dict[Any, Any] | list[Any]] = []  # the dicts and lists holding what was found
        self._seen: set[int] = set()
        self._registered = {id(m) for m in module.modules()}
        self._parameters = {id(p) for _, p in module.named_parameters(remove_duplicate=False)}
        for name, submodule in module.named_modules(remove_duplicate=True):
            self._module(submodule, name)

    def _module(self, module: nn.Module, prefix: str) -> None:
        self.tables += [vars(module), module._buffers]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                self._tensor(buffer, _join(prefix, name))
        for name, value in vars(module).items():
            if name not in _MODULE_INTERNALS:
                self._value(value, _join(prefix, name), 0)

    def _tensor(self, tensor: torch.Tensor, path: str) -> None:
        if id(tensor) in self._parameters or isinstance(tensor, nn.Parameter):
            return
        if tensor.device.type == "meta" or isinstance(tensor, FakeTensor):
            return
        self.found.setdefault(path, tensor)

    def _value(self, value: Any, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            self._tensor(value, path)
            return
        if depth >= _DEPTH or id(value) in self._seen or len(self._seen) >= _MAX_OBJECTS:
            return
        if isinstance(value, nn.Module):
            if id(value) not in self._registered:  # held in a list or object, not registered: walked as an object
                self._seen.add(id(value))
                self._module(value, path)
            return
        if isinstance(value, dict):
            self._seen.add(id(value))
            self.tables.append(value)
            for key, item in list(value.items()):
                if isinstance(key, (str, int)):
                    self._value(item, f"{path}[{key!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            self._seen.add(id(value))
            if isinstance(value, list):
                self.tables.append(value)
            for index, item in enumerate(value):
                self._value(item, f"{path}[{index}]", depth + 1)
        elif _walkable(value):
            self._seen.add(id(value))
            self.tables.append(vars(value))
            for name, item in list(vars(value).items()):
                self._value(item, _join(path, name), depth + 1)


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def _storage(tensor: torch.Tensor) -> int:
    try:
        pointer = int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no real storage (a tensor subclass)
        return id(tensor)
    return pointer or id(tensor)  # every empty tensor's storage is at 0


@dataclass
class _Seen:
    tensor: torch.Tensor
    version: int | None
    value: torch.Tensor | None  # a clone, only for a tensor without a version counter


def _listed(module: nn.Module) -> dict[str, _Seen]:
    listed = {}
    for path, tensor in _Reachable(module).found.items():
        version = _version(tensor)
        listed[path] = _Seen(tensor, version, tensor.detach().clone() if version is None else None)
    return listed


def _changes(before: Mapping[str, _Seen], after: Mapping[str, _Seen]) -> Iterator[tuple[str, str]]:
    """``(path, how)`` for each tensor a call changed: created, rebound or written in place."""
    for path, now in after.items():
        then = before.get(path)
        if then is None:
            yield path, "created"
        elif then.tensor is not now.tensor:
            yield path, "rebound to a new tensor"
        elif then.version is not None and now.version != then.version:
            yield path, "written in place"
        elif then.value is not None and not torch.equal(then.value, now.tensor):
            yield path, "written in place"


def _copy_sharing_parameters(module: nn.Module) -> nn.Module:
    shared: dict[int, Any] = {id(p): p for _, p in module.named_parameters(remove_duplicate=False)}
    return copy.deepcopy(module, shared)


@contextmanager
def _restored(module: nn.Module) -> Iterator[None]:
    """Leave ``module`` after the block as it was before: the contents of every table the walk
    goes through (attributes, buffers, dicts, lists) and every tensor's value."""
    reachable = _Reachable(module)
    tables = [(table, copy.copy(table)) for table in reachable.tables]
    unique = {id(t): t for t in reachable.found.values()}.values()
    values = [(tensor, tensor.detach().clone()) for tensor in unique]
    try:
        yield
    finally:
        for table, content in tables:
            if isinstance(table, dict):
                table.clear()
                table.update(cast("dict[Any, Any]", content))
            else:
                table[:] = content
        with torch.no_grad():
            for tensor, value in values:
                # Only what changed: a tensor nothing wrote keeps its version counter.
                if not torch.equal(tensor, value):
                    tensor.copy_(value)


def _working_copy(module: nn.Module) -> tuple[nn.Module, AbstractContextManager[None]]:
    """A copy of ``module`` sharing its parameters; a module that cannot be copied (it holds a
    lock, a file) is worked on itself. Either way ``module`` is restored afterwards
    (:func:`_restored`): a copy can still reach the original (a ``forward`` replaced on the
    instance by a closure over it, as ExecuTorch's example wrappers do, is copied as the same
    function), so its calls may write the original's buffers."""
    try:
        return _copy_sharing_parameters(module), _restored(module)
    except Exception:  # deepcopy raises whatever an attribute's __deepcopy__/__reduce__ raises
        return module, _restored(module)


def carried_states(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None
) -> list[CarriedState]:
    """The tensors ``module`` carries from call to call, found by calling a copy of it twice
    at ``args``/``kwargs`` (see the module's algorithm). ``module`` and the inputs are left
    as they were; the calls run under ``no_grad`` in the module's current mode.

    Errors raised by the model's ``forward`` propagate.
    """
    working, kept_as_it_was = _working_copy(module)
    with kept_as_it_was:
        listed = [_listed(working)]
        with torch.no_grad():
            for _ in range(2):
                inputs = pytree.tree_map_only(torch.Tensor, torch.clone, (tuple(args), dict(kwargs or {})))
                working(*inputs[0], **inputs[1])
                listed.append(_listed(working))
        buffers: dict[int, list[str]] = {}
        for name, buffer in working.named_buffers(remove_duplicate=False):
            buffers.setdefault(_storage(buffer), []).append(name)
    changed: dict[str, list[str]] = {}
    for call in (1, 2):
        for path, how in _changes(listed[call - 1], listed[call]):
            changed.setdefault(path, []).append(f"{how} by call {call}")
    final = {**listed[1], **listed[2]}  # a tensor created by call 1 and dropped by call 2 is named too
    by_storage: dict[int, list[str]] = {}
    for path in changed:
        by_storage.setdefault(_storage(final[path].tensor), []).append(path)
    states = []
    for storage, paths in by_storage.items():
        names = tuple(buffers.get(storage, ()))
        path = names[0] if names else min(paths, key=lambda p: (len(p), p))
        tensor = final[path].tensor if path in final else final[paths[0]].tensor
        change = ", ".join(changed.get(path, changed[paths[0]]))
        states.append(CarriedState(path, tuple(tensor.shape), tensor.dtype, change, names))
    return states


def mutated_buffers(program: ExportedProgram) -> list[str]:
    """The registered buffers ``program`` mutates: those its signature says it writes back
    (``buffers_to_mutate``, a functional program) and those an op of its graph writes in
    place (``torch.export``'s graph keeps in-place ops until it is decomposed)."""
    signature = program.graph_signature
    written = written_placeholders(program.graph_module.graph)
    found = set(signature.buffers_to_mutate.values())
    found.update(target for placeholder, target in signature.inputs_to_buffers.items() if placeholder in written)
    return sorted(found)


def check_state_kept(program: ExportedProgram, states: list[CarriedState], what: str) -> None:
    """Refuse ``program`` when it does not keep every state the eager model carries.

    A state is kept when one of the registered buffers sharing its storage is among the
    program's mutated buffers (:func:`mutated_buffers`).

    :param states: :func:`carried_states` of the exported module.
    :param what: what the error names (``model 'name'``).
    :raises StateLostError: naming each dropped state (its path, shape, dtype and how the
        eager calls changed it), the states the program keeps, and what to do.
    """
    kept = mutated_buffers(program)
    lost = [s for s in states if not set(s.buffers) & set(kept)]
    if not lost:
        return
    named = "; ".join(s.describe() for s in lost[:_NAMED_AT_MOST])
    if len(lost) > _NAMED_AT_MOST:
        named += f"; and {len(lost) - _NAMED_AT_MOST} more"
    keeps = f"it keeps only {', '.join(kept)}" if kept else "it keeps no state at all"
    raise StateLostError(
        f"{what}: the exported program drops state the eager model carries from call to call: "
        f"{len(lost)} tensor(s) that eager PyTorch changes between calls are no mutated buffer of the program "
        f"({keeps}): {named}. The program would start every call from their first-call values and answer "
        "wrongly from the second call on, so nothing was lowered. Fix: allocate each such tensor in the "
        "module's __init__ and register it as a buffer (register_buffer), and have forward write it in place "
        "(copy_, index_copy_, slice assignment) instead of creating it on the first call or rebinding the attribute.",
        lost,
        kept,
    )
