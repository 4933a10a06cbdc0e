"""The weights eager PyTorch runs with when ``run`` and the benches check a program: those exported.

A factory that initialises its weights randomly (unseeded, as a tutorial's toy model does)
builds another model each time it is called, so an eager model built apart from the one
exported is compared against other weights and every step "differs". Two ways keep the
comparison honest, the user's choice of memory (``writeback run --eager-weights``):

1. ``copy``: build once; before export, keep a deep copy of the module (buffers and any
   tensor it holds, in their state before any call; its parameters shared, since a call never
   writes them); eager runs that copy. No second copy of the weights.
2. ``rebuild``: before the exported program is released, take a checksum of each of its
   parameters and buffers; build the model again for eager and refuse
   (:class:`WeightsDiffer`, naming the first differing tensor) unless every tensor the two
   share by name is equal. A checksum per tensor, no second copy while lowering.
3. ``auto`` (the default): ``copy`` while the copy takes at most half the memory the
   machine has available, else ``rebuild``.

A case with its own export recipe (``ModelCase.exported``) builds its module itself: the
program's weights are then checked as ``rebuild`` checks them, whatever the choice.

Example it must refuse (``rebuild``): a factory returning ``nn.Linear(4, 4)`` unseeded.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch.export import ExportedProgram
from writeback_core.types import ModelCase

from writeback.model_build import build_case_module

__all__ = ["EAGER_WEIGHTS_HELP", "EagerWeights", "ExportedWeights", "WeightsDiffer", "available_bytes", "same_weights"]

EagerWeights = Literal["auto", "copy", "rebuild"]

EAGER_WEIGHTS_HELP = (
    "Which weights eager PyTorch checks the program with; always those exported, even from a factory that "
    "initialises them randomly. copy: build the model once and keep a copy of it, taken before export, for "
    "eager (its buffers copied, its parameters shared). rebuild: build it again for eager and refuse, naming the "
    "first differing tensor, when its parameters or buffers differ from those exported (a checksum per tensor, "
    "no second copy while lowering). auto: copy when the copy takes at most half the available memory, else "
    "rebuild."
)


class WeightsDiffer(ValueError):
    """The model built again for eager has other weights than the build that was exported."""


def available_bytes() -> int | None:
    """Bytes of memory the machine has available (``MemAvailable``), ``None`` where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def _named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers, by their dotted names (tied ones under each name)."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _nbytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers, each storage counted once."""
    seen: dict[int, int] = {}
    for _, tensor in _named_tensors(module):
        try:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


@dataclass(frozen=True)
class _Checksum:
    """What identifies one tensor's value: shape, dtype, a digest of its bytes, its first element."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    digest: str | None  # None: a tensor whose bytes cannot be read (a subclass); compared by shape only
    first: float | None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Checksum:
        tensor = tensor.detach()
        try:
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            digest: str | None = hashlib.blake2b(raw.data, digest_size=16).hexdigest()
        except (RuntimeError, TypeError, NotImplementedError):
            digest = None
        try:
            first = float(tensor.reshape(-1)[0]) if tensor.numel() else None
        except (RuntimeError, TypeError, NotImplementedError):
            first = None
        return cls(tuple(tensor.shape), tensor.dtype, digest, first)

    def described(self) -> str:
        first = f", first element {self.first:.6g}" if self.first is not None else ""
        return f"shape {list(self.shape)}, {self.dtype}{first}"


def _program_checksums(program: ExportedProgram) -> dict[str, _Checksum]:
    """A checksum of each tensor ``program`` holds by name (its state dict and its constants)."""
    found = {name: _Checksum.of(t) for name, t in program.state_dict.items() if isinstance(t, torch.Tensor)}
    for name, value in program.constants.items():
        if isinstance(value, torch.Tensor):
            found.setdefault(name, _Checksum.of(value))
    return found


_RUN_ADVICE = (
    "seed it (torch.manual_seed) or load its weights, or run with --eager-weights copy to check the program "
    "against a copy of the exported build (its parameters shared, no second copy of the weights)"
)


def _first_difference(
    case: str,
    exported: Mapping[str, _Checksum],
    module: torch.nn.Module,
    again: str = "building it again for eager PyTorch gave other weights than the build that was exported",
    advice: str = _RUN_ADVICE,
    was: str = "was exported with",
) -> str | None:
    """Why ``module``'s weights are not those exported (the first tensor that differs), or ``None``."""
    for name, tensor in _named_tensors(module):
        wanted = exported.get(name)
        if wanted is None:
            continue
        found = _Checksum.of(tensor)
        if found != wanted:
            kind = "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"
            return (
                f"model {case!r}: {again}: {kind} {name!r} {was} {wanted.described()} and is now "
                f"{found.described()}. The factory initialises its weights differently on each call (unseeded "
                f"random initialisation, say): {advice}"
            )
    return None


def _copy_sharing_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` deep-copied but for its parameters, which the copy shares: a call mutates
    buffers and attributes, never parameters, so eager's copy keeps the state before any call
    without a second copy of the weights."""
    shared = {id(p): p for _, p in module.named_parameters(remove_duplicate=False)}
    return copy.deepcopy(module, shared)


@dataclass
class ExportedWeights:
    """Watches the build of a case while it is lowered, to hand eager the weights exported.

    Lower :attr:`case` (its ``build`` is watched), call :meth:`record` with the exported
    program before releasing it, then :meth:`eager_module` gives eager's module.
    """

    original: ModelCase
    mode: EagerWeights = "auto"
    case: ModelCase = field(init=False)
    chosen: Literal["copy", "rebuild"] | None = field(init=False, default=None)
    _copy: torch.nn.Module | None = field(init=False, default=None)
    _checksums: dict[str, _Checksum] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.mode not in get_args(EagerWeights):
            raise ValueError(f"eager weights {self.mode!r}: choose one of {', '.join(get_args(EagerWeights))}")
        self.case = dataclasses.replace(self.original, build=self._build)

    def _build(self) -> torch.nn.Module:
        module = build_case_module(self.original)
        self.chosen = self._choose(module)
        self._copy = _copy_sharing_parameters(module) if self.chosen == "copy" else None
        return module

    def _choose(self, module: torch.nn.Module) -> Literal["copy", "rebuild"]:
        if self.mode != "auto":
            return self.mode
        available = available_bytes()
        return "copy" if available is None or 2 * _nbytes(module) <= available else "rebuild"

    def record(self, exported: ExportedProgram, checksums: bool = False) -> None:
        """Take the checksums ``rebuild`` and :meth:`checked_rebuild` compare with (none when a
        copy is kept, unless ``checksums``: a later :meth:`checked_rebuild` is wanted)."""
        self._checksums = _program_checksums(exported) if self._copy is None or checksums else None

    def eager_module(self) -> torch.nn.Module:
        """The module eager runs: the copy kept, else a new build whose weights equal those exported.

        :raises WeightsDiffer: the new build's parameters or buffers differ from those exported.
        """
        if self._copy is not None:
            module, self._copy = self._copy, None
            return module
        return self.checked_rebuild()

    def checked_rebuild(self, purpose: str = "eager PyTorch", advice: str = _RUN_ADVICE) -> torch.nn.Module:
        """A new build (for ``purpose``) whose weights equal those :meth:`record` saw exported.

        :raises WeightsDiffer: the new build's parameters or buffers differ from those exported
            (the message ends with ``advice``).
        """
        module = build_case_module(self.original)
        again = f"building it again for {purpose} gave other weights than the build that was exported"
        problem = _first_difference(self.original.name, self._checksums or {}, module, again, advice)
        if problem is not None:
            raise WeightsDiffer(problem)
        return module


def same_weights(case: ModelCase) -> ModelCase:
    """``case`` whose every ``build()`` after the first must give the first build's weights, for the
    benches: each lowering and the eager reference build their own module (one model's weights
    alive at a time, as before) and a build whose parameters or buffers differ from the first
    raises :class:`WeightsDiffer` naming the first tensor that differs."""
    first: dict[str, _Checksum] = {}

    def build() -> torch.nn.Module:
        module = build_case_module(case)
        if not first:
            first.update((name, _Checksum.of(tensor)) for name, tensor in _named_tensors(module))
            return module
        again = "a bench builds it once per row and this build gave other weights than the first"
        advice = "seed it (torch.manual_seed) or load its weights"
        problem = _first_difference(case.name, first, module, again, advice, "was first built with")
        if problem is not None:
            raise WeightsDiffer(problem)
        return module

    return dataclasses.replace(case, build=build)
