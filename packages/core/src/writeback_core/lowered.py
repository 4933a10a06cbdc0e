"""What a lowering made (:func:`writeback_core.lowering.lower`): the ``.pte``, what became of
each mutation, where each state lives (:func:`state_places`), and what a runtime call's
inputs must be (:class:`InputSignature`), all still answering once the program is released.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from writeback_core.mutations import Mutation, MutationKind
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import InPlaceDecision

if TYPE_CHECKING:
    from executorch.exir import ExecutorchProgramManager

    from writeback_core.copies import CopyLeft
    from writeback_core.stored_once import StoredOnce
    from writeback_core.types import MemoryPlan, ModelCase

__all__ = ["WEIGHTS_TAG", "InputSignature", "Lowered", "Released", "ReleasedError", "StatePlace", "state_places"]

#: The name exir and XNNPACK file every weight under when a lowering keeps the weights apart
#: from the program (``weights_apart``): one data file (``.ptd``, ExecuTorch's program-data
#: separation) in which exir stores bytes that two weights share, a tied embedding and LM
#: head, once.
WEIGHTS_TAG = "weights"

# The cause of a copy left when no backend was chosen.
_NO_BACKEND = "no backend was chosen, so no plugin decided (the portable backend runs the same kernels in place)"


@dataclass(frozen=True)
class InputSignature:
    """What a runtime call's inputs must be, read once from a program: the in_spec, the user
    inputs' arguments and the placeholders (``ExportedProgram.call_spec`` builds a new
    named-tuple type on every read, and finding the placeholders walks the whole graph)."""

    in_spec: pytree.TreeSpec | None
    user: tuple[Any, ...]
    placeholders: Mapping[str, torch.fx.Node]

    @classmethod
    def of(cls, program: ExportedProgram) -> InputSignature:
        user = tuple(s.arg for s in program.graph_signature.input_specs if s.kind is InputKind.USER_INPUT)
        placeholders = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
        return cls(program.call_spec.in_spec, user, placeholders)


class Released:
    """What :meth:`Lowered.release` leaves in place of the exported program, the program
    manager and the ``.pte`` bytes: any use says what happened and what to do."""

    def __init__(self, what: str) -> None:
        self._what = what

    def _refuse(self) -> ReleasedError:
        return ReleasedError(
            f"this lowering's {self._what} was released once its .pte was written and loaded "
            "(Lowered.release(), as writeback run does before its steps); read the .pte file, or lower again"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._refuse()

    def __len__(self) -> int:
        raise self._refuse()

    def __getitem__(self, key: Any) -> Any:
        raise self._refuse()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    def __bytes__(self) -> bytes:
        raise self._refuse()


class ReleasedError(RuntimeError):
    """A released :class:`Lowered`'s exported program, program manager or ``.pte`` bytes were read."""


@dataclass
class Lowered:
    """A program taken through :func:`~writeback_core.lowering.lower`: its ``.pte`` and what became of its mutations.

    ``write_back_bytes`` maps each state still written back whole by a ``copy_`` in the
    final program to the bytes that copy moves per call; ``passes`` names the registered
    program passes that ran (empty when lowered without a registry).

    :meth:`release` drops ``exported``, ``program`` and ``pte`` (each holds the weights)
    and keeps what a report reads: the mutations and decisions, ``pte_nbytes``,
    :attr:`copies_left` and :func:`state_places`.

    The ``.pte`` stays in exir's serialized pieces until :attr:`pte` is read:
    :meth:`write_pte` writes the file from them, without the contiguous copy of the
    weights that joining them into ``bytes`` makes.
    """

    exported: ExportedProgram
    mutations: list[Mutation]
    decisions: dict[str, InPlaceDecision]
    program: ExecutorchProgramManager
    write_back_bytes: dict[str, int]
    user_input_mutations: int
    backend: str | None
    plan: MemoryPlan
    passes: tuple[str, ...]
    seconds: float
    case: ModelCase | None = None
    #: The weights are in a data file of their own (:meth:`write_weights`), not in the ``.pte``.
    weights_apart: bool = False
    #: Delegates' named data the ``.pte`` reads from a program constant's bytes, stored once
    #: (a tied embedding/LM head: :func:`writeback_core.stored_once.store_named_data_once`).
    stored_once: tuple[StoredOnce, ...] = ()
    _after_release: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _pte: bytes | None = field(default=None, repr=False, compare=False)
    _written_nbytes: int | None = field(default=None, repr=False, compare=False)

    @property
    def pte(self) -> bytes:
        """The ``.pte`` as bytes, joined from the serialized program on the first read (a
        copy of the weights: :meth:`write_pte` writes the file without it)."""
        if self.released:
            raise Released(".pte bytes")._refuse()
        if self._pte is None:
            with known_warnings_ignored():
                self._pte = bytes(self.program.buffer)
        return self._pte

    def write_pte(self, path: Path) -> None:
        """Write the ``.pte`` to ``path``, streaming exir's serialized pieces unless :attr:`pte`
        was already read. The file is written where it is: a command that must leave an old
        file whole on failure writes to a temporary path and renames it (the app's
        ``writeback._files.replacing``).

        :raises OSError: the file cannot be written.
        """
        if self.released:
            raise Released(".pte bytes")._refuse()
        if self._pte is not None:
            path.write_bytes(self._pte)
        else:
            with open(path, "wb") as handle, known_warnings_ignored():
                self.program.write_to_file(handle)
        self._written_nbytes = path.stat().st_size

    def write_weights(self, path: Path) -> bool:
        """Write the weights' data file (``.ptd``) of a lowering that keeps them apart
        (``lower(..., weights_apart=True)``) to ``path``; a runtime loads it beside the ``.pte``
        (``TextLLMRunner(PTE, TOKENIZER, PTD)``, ``Runtime.load_program(PTE, data_path=PTD)``).
        Returns False, writing nothing, for a lowering whose weights are in the ``.pte``.

        :raises OSError: the file cannot be written.
        """
        if self.released:
            raise Released("weights")._refuse()
        if not self.weights_apart:
            return False
        with tempfile.TemporaryDirectory(prefix=".writeback-weights-", dir=path.parent) as folder:
            self.program.write_tensor_data_to_file(folder)
            os.replace(Path(folder) / f"{WEIGHTS_TAG}.ptd", path)
        return True

    @property
    def released(self) -> bool:
        """Whether :meth:`release` dropped the program."""
        return bool(self._after_release)

    def release(self) -> None:
        """Drop the exported program, the program manager and the ``.pte`` bytes, three
        holders of the weights, once the ``.pte`` is written and loaded: a run's steps then
        hold the runtime's copy alone. Reading any of the three afterwards raises
        :class:`ReleasedError`; ``pte_nbytes``, :attr:`copies_left` and :func:`state_places`
        and :attr:`input_signature` keep answering (worked out before the release).

        The memory is the process's to return: a command that wants it back now calls the
        app's ``writeback.process_memory.return_freed_memory()`` after this."""
        if self.released:
            return
        after_release = {
            "pte_nbytes": self.pte_nbytes,
            "copies_left": self.copies_left,
            "places": state_places(self),
            "input_signature": self.input_signature,
        }
        self.exported = cast("ExportedProgram", Released("exported program"))
        self.program = cast("ExecutorchProgramManager", Released("program manager"))
        self._pte = None
        self._after_release = after_release

    @property
    def input_signature(self) -> InputSignature:
        """What a runtime call's inputs must be, read from the exported program (after
        :meth:`release` too)."""
        if self.released:
            return cast("InputSignature", self._after_release["input_signature"])
        return InputSignature.of(self.exported)

    @property
    def pte_nbytes(self) -> int:
        """The ``.pte``'s size in bytes (after :meth:`release` too)."""
        if self.released:
            return int(self._after_release["pte_nbytes"])
        if self._pte is None and self._written_nbytes is not None:
            return self._written_nbytes
        return len(self.pte)

    @property
    def copied_per_call(self) -> int:
        """Bytes of whole-state write-back copies the program makes every call."""
        return sum(self.write_back_bytes.values())

    @property
    def copies_left(self) -> list[CopyLeft]:
        """Each whole-state copy :attr:`write_back_bytes` counts, with its cause and what to do."""
        from writeback_core.copies import copies_left

        if self.released:
            return list(self._after_release["copies_left"])
        return copies_left(self.decisions, self.program.exported_program())

    @property
    def passes_run(self) -> bool:
        """Whether any registered program pass ran."""
        return bool(self.passes)


@dataclass(frozen=True)
class StatePlace:
    """Where one mutated state lives in a lowered program, and what writing it costs per call.

    ``owner``: ``"caller"`` (a tensor the caller passes, bound in place), ``"program"`` (a
    mutable buffer of the ``.pte``) or ``"delegate"`` (a buffer that moved inside delegate
    ``delegate``). ``delegate`` is the index of the delegate among the program's (in call
    order) that holds the state or, for a caller or program state, that writes it in place;
    ``writers`` lists every delegate the state is handed to when there are several.
    ``in_place`` is core's decision (a plugin accepted writing it in place); ``copy_bytes``
    the bytes of the whole-state write-back ``copy_`` left in the program per call (0: none)
    and ``why`` its cause (:attr:`Lowered.copies_left`).
    """

    mutation: Mutation
    owner: Literal["caller", "program", "delegate"]
    backend: str | None
    delegate: int | None
    writers: tuple[int, ...]
    in_place: bool
    copy_bytes: int
    why: str = ""


def state_places(lowered: Lowered) -> list[StatePlace]:
    """Where each of ``lowered``'s mutations lives in the final program (``find_mutations`` order).

    Read from the program itself: the delegates' own signatures (a buffer a delegate
    mutates is inside it), the arguments of each delegate call, core's recorded in-place
    decisions (:attr:`Lowered.decisions`, delegate-owned ones included) and the
    write-back copies left (:attr:`Lowered.write_back_bytes`).
    """
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    if lowered.released:
        return list(lowered._after_release["places"])
    final = lowered.program.exported_program()
    signature = final.graph_signature
    delegates = get_lowered_submodules(final.graph_module)
    inside: dict[str, int] = {}
    handed: dict[str, list[int]] = {}
    for number, (_, module, call) in enumerate(delegates):
        for target in module.original_module.graph_signature.buffers_to_mutate.values():
            inside.setdefault(target, number)
        for arg in call.args[1:]:
            if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
                handed.setdefault(arg.name, []).append(number)
    buffer_placeholders = {target: name for name, target in signature.inputs_to_buffers.items()}
    if lowered.backend is None:
        causes = {c.state: _NO_BACKEND for c in lowered.copies_left}
    else:
        causes = {c.state: c.reason for c in lowered.copies_left}
    user_inputs = list(signature.user_inputs)
    places = []
    for mutation in lowered.mutations:
        decision = lowered.decisions.get(mutation.target)
        backend = decision.backend if decision is not None else lowered.backend
        in_place = decision is not None and decision.accepted
        if mutation.kind is MutationKind.USER_INPUT:
            index = mutation.user_input_index
            placeholder = user_inputs[index] if index is not None and index < len(user_inputs) else None
            owner: Literal["caller", "program", "delegate"] = "caller"
        elif mutation.target in inside and mutation.target not in buffer_placeholders:
            places.append(StatePlace(mutation, "delegate", backend, inside[mutation.target], (), in_place, 0))
            continue
        else:
            placeholder, owner = buffer_placeholders.get(mutation.target), "program"
        writers = tuple(handed.get(placeholder, ())) if isinstance(placeholder, str) else ()
        copy = lowered.write_back_bytes.get(placeholder, 0) if isinstance(placeholder, str) else 0
        writer = writers[0] if in_place and len(writers) == 1 else None
        why = causes.get(mutation.target, "") if copy else ""
        places.append(StatePlace(mutation, owner, backend, writer, writers, in_place, copy, why))
    return places
