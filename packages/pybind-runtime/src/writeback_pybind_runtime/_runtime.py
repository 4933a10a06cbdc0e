"""The Python API: ``Runtime.get().load_program(...).load_method(name)``, shaped like
``executorch.runtime``, over the compiled ``_native`` extension.

Contracts that differ from stock ``executorch.runtime`` 1.5.1 (each has a test):

- A method input that the method mutates is updated in the caller's tensor: a
  memory-planned input is copied back after each call; an unplanned one
  (``MemoryPlanningPass(alloc_graph_input=False)``) is used in place, no copy.
- Tensors passed to ``set_inputs`` stay alive until the next successful
  ``set_inputs``, so temporaries are safe.
- An unplanned output that nobody bound gets storage from this runtime.
- ``Method.set_output(tensor, index)`` binds an unplanned output to caller
  storage; ``set_output(None, index)`` unbinds it.
- Python delegates from the ``writeback_runtime_delegates`` hook run as
  ExecuTorch backends; their exceptions come back as :class:`DelegateError`.
- A ``Method`` refuses a second concurrent call with ``RuntimeError``; separate
  methods run concurrently.
- A program loaded from a path reads its plan and constants at ``load_program``;
  ``load_method`` maps the delegate data it needs only while it loads (a range
  a delegate still holds then is copied into the program's memory): a loaded
  method never reads the file again, and a file changed before or while
  ``load_method`` runs is refused (a file cut under the mapping included).
- Before a call runs, every tensor it reads or writes in caller memory must
  still have the storage its shape needs, and a tensor it writes must not
  require grad while grad mode is on; otherwise ``ValueError``, nothing run.
- A decoder program (one carrying ExecuTorch's LLM-runner metadata) has its
  ``forward`` calls checked against the runner's contract before they run:
  ``ValueError`` naming the input, the value and the bound (:class:`DecoderContract`).
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from writeback_pybind_runtime import _pte
from writeback_pybind_runtime._errors import DelegateError, ProgramError
from writeback_pybind_runtime._libs import native

if TYPE_CHECKING:
    from writeback_core.registry import Registry
    from writeback_core.types import RuntimeDelegate

__all__ = [
    "DecoderContract",
    "DelegateError",
    "Method",
    "MethodMetadata",
    "Program",
    "ProgramError",
    "Runtime",
    "ValueMetadata",
    "Verification",
    "set_log_level",
]


class Verification(enum.IntEnum):
    """How much of a program the runtime checks when loading it (ExecuTorch's enum)."""

    Minimal = 0
    InternalConsistency = 1


@dataclass(frozen=True)
class ValueMetadata:
    """One input or output of a method, as the program declares it.

    ``is_input`` (outputs only) is the index of the input that is the same value
    (a mutated input, or an input returned as is); ``repeats`` the other output
    indices returning the same value. Tensor fields are ``None`` for non-tensors.
    """

    tag: str
    dtype: str | None = None
    sizes: tuple[int, ...] | None = None
    memory_planned: bool | None = None
    nbytes: int | None = None
    is_input: int | None = None
    repeats: tuple[int, ...] = ()
    bound: bool = False


@dataclass(frozen=True)
class MethodMetadata:
    """What a method takes and returns, and the memory it plans."""

    name: str
    inputs: tuple[ValueMetadata, ...]
    outputs: tuple[ValueMetadata, ...]
    memory_planned_buffers: tuple[int, ...]
    backends: tuple[str, ...]

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)


def _value(raw: Mapping[str, Any]) -> ValueMetadata:
    sizes = raw.get("sizes")
    return ValueMetadata(
        tag=raw["tag"],
        dtype=raw.get("dtype"),
        sizes=tuple(sizes) if sizes is not None else None,
        memory_planned=raw.get("memory_planned"),
        nbytes=raw.get("nbytes"),
        is_input=raw.get("is_input"),
        repeats=tuple(raw.get("repeats", ())),
        bound=bool(raw.get("bound", False)),
    )


@dataclass(frozen=True)
class DecoderContract:
    """What a decoder program's ``forward(tokens, positions)`` accepts, from the runner metadata
    the program carries (exir constant methods: ``get_max_context_len``, ``get_max_seq_len``,
    ``get_vocab_size``), the contract ExecuTorch's LLM runner calls it with
    (:mod:`writeback_core.llm_runner`).

    ``check`` refuses a call that breaks it, before anything is installed, with a ``ValueError``
    naming the input, the value and the bound. The program's own in-graph checks
    (``check_runner_inputs``) refuse the same calls in any runtime, but ExecuTorch's index
    kernel can only say ``InvalidArgument`` and log a shifted index; this says which input.
    """

    cache: int  # get_max_context_len: every position lies in [0, cache)
    per_call: int  # get_max_seq_len: the most tokens one call takes
    vocab: int | None  # get_vocab_size: token ids lie in [0, vocab)
    one_position: bool  # positions is ET's input_pos [1] (the first position), not one per token

    @classmethod
    def of(cls, program: Program, inputs: Sequence[Mapping[str, Any]]) -> DecoderContract | None:
        """The contract of ``program``'s ``forward`` whose declared ``inputs`` are these, or None when
        the program is no runner-ready decoder (no cache length, or inputs not int64 ``[1, n]`` and
        int64 of one dim)."""
        shapes = [tuple(v.get("sizes") or ()) if v.get("tag") == "Tensor" else None for v in inputs]
        dtypes = [v.get("dtype") for v in inputs]
        if len(inputs) != 2 or shapes[0] is None or shapes[1] is None:
            return None
        if len(shapes[0]) != 2 or len(shapes[1]) != 1 or any(not str(d).endswith("int64") for d in dtypes):
            return None
        values = program.constant_values(("get_max_context_len", "get_max_seq_len", "get_vocab_size"))
        cache, per_call, vocab = (values.get(k) for k in ("get_max_context_len", "get_max_seq_len", "get_vocab_size"))
        if cache is None or cache < 1:
            return None
        return cls(
            cache=cache,
            per_call=min(per_call or cache, cache, shapes[0][1]),
            vocab=vocab if vocab is not None and vocab >= 1 else None,
            one_position=shapes[1][0] == 1 and shapes[0][1] > 1,
        )

    def check(self, inputs: Sequence[Any]) -> None:
        """Refuse ``inputs`` (``[tokens, positions]``) that break the contract: ``ValueError``.

        Inputs of another dtype or rank are left to the method's own checks, which name them.
        """
        if len(inputs) != 2:
            return
        tokens, positions = inputs
        if not (_is_int64(tokens, 2) and _is_int64(positions, 1)):
            return
        batch, n = (int(d) for d in tokens.shape)
        where = "forward input 0 (tokens)"
        if batch != 1:
            raise ValueError(
                f"{where}: batch {batch}; a decoder takes batch 1 (tokens [1, n]); got shape {list(tokens.shape)}"
            )
        if not 1 <= n <= self.per_call:
            raise ValueError(
                f"{where}: {n} tokens; one call takes 1 to {self.per_call} (get_max_seq_len, the cache's "
                f"{self.cache} positions at most): split a longer prompt into calls"
            )
        if self.vocab is not None:
            low, high = _bounds(tokens)
            bad = low if low < 0 else high
            if low < 0 or high >= self.vocab:
                raise ValueError(
                    f"{where}: token id {bad} is outside the vocabulary; token ids must be in [0, {self.vocab}) "
                    "(get_vocab_size)"
                )
        self._check_positions(positions, n)

    def _check_positions(self, positions: Any, n: int) -> None:
        where = "forward input 1 (positions)"
        m = int(positions.shape[0])
        want = 1 if self.one_position else n
        if m != want:
            kind = "the first position of the call (input_pos)" if self.one_position else "one per token"
            entries = "entry" if m == 1 else "entries"
            raise ValueError(f"{where}: {m} {entries} for {n} tokens; this program takes {want}: {kind}")
        low, high = _bounds(positions)
        bound = f"positions must be in [0, {self.cache}) (the cache's length, get_max_context_len)"
        if low < 0:
            raise ValueError(f"{where}: position {low} is below 0; {bound}")
        if high >= self.cache:
            raise ValueError(f"{where}: position {high} is past the cache's end; {bound}")
        last = int(positions[0]) + n - 1
        if last >= self.cache:
            raise ValueError(
                f"{where}: the call writes rows {int(positions[0])} to {last} (positions[0] + {n} tokens - 1), "
                f"past the cache's end; the last row written must be below {self.cache} (get_max_context_len)"
            )


def _bounds(value: Any) -> tuple[int, int]:
    """The smallest and the largest element of a non-empty integer tensor (one reduction)."""
    low, high = value.aminmax()
    return int(low), int(high)


def _is_int64(value: Any, rank: int) -> bool:
    return str(getattr(value, "dtype", "")) == "torch.int64" and len(getattr(value, "shape", ())) == rank


class Method:
    """One loaded method: its own planned memory, inputs and output bindings.

    Threads: one call at a time per ``Method``. ``set_inputs``, ``execute``,
    ``get_outputs``, ``__call__`` and ``set_output`` each mark the method busy
    while they run (``execute`` runs with the GIL released); a call that finds it
    busy (another thread, or a delegate calling back into it) raises
    ``RuntimeError`` and changes nothing. Separate ``Method`` objects, of one
    :class:`Program` or several, run concurrently from several threads: load one
    per thread. ``set_inputs`` then ``execute`` then ``get_outputs`` from two
    threads on one method can still interleave between the calls; ``__call__``
    and ``execute(inputs)`` do all three as one call.
    """

    def __init__(self, native_method: Any, contract: DecoderContract | None = None) -> None:
        self._native = native_method
        self._contract = contract
        # The largest shape of each tensor input, as the program declares it (None: not a tensor).
        self._largest = tuple(
            tuple(v["sizes"]) if v["tag"] == "Tensor" and v.get("sizes") is not None else None
            for v in native_method.metadata()["inputs"]
        )

    def _check_sizes(self, inputs: Sequence[Any] | None) -> None:
        """Refuse a tensor input with a dim larger than the method declares (its largest shape).

        ExecuTorch resizes an input that has a dynamic dim to any shape of the same rank whose
        element count fits its capacity, so tokens ``[2, 3]`` pass for ``[1, 16]`` and reach
        kernels that abort on them; checked here, before anything is installed.
        """
        if inputs is None:
            return
        if self._contract is not None:
            self._contract.check(inputs)
        for index, (value, largest) in enumerate(zip(inputs, self._largest, strict=False)):
            shape = getattr(value, "shape", None)
            if largest is None or shape is None or len(shape) != len(largest):
                continue  # not a tensor input, or a rank the native check names
            for dim, (got, most) in enumerate(zip(shape, largest, strict=True)):
                if int(got) > most:
                    raise ValueError(
                        f"input {index} of method {self.name!r}: dimension {dim} is {int(got)}, more than "
                        f"the {most} the method takes (its largest shape is {list(largest)}); got shape "
                        f"{list(shape)}"
                    )

    @property
    def name(self) -> str:
        return str(self._native.name)

    @property
    def metadata(self) -> MethodMetadata:
        """The method's inputs, outputs, planned buffers and backends."""
        raw = self._native.metadata()
        return MethodMetadata(
            name=raw["name"],
            inputs=tuple(_value(v) for v in raw["inputs"]),
            outputs=tuple(_value(v) for v in raw["outputs"]),
            memory_planned_buffers=tuple(raw["memory_planned_buffers"]),
            backends=tuple(raw["backends"]),
        )

    def set_inputs(self, inputs: Sequence[Any]) -> None:
        """Install every input (tensors, ints, floats, bools), all or nothing.

        A tensor is used in place when the input is not memory planned; it is
        kept alive until the next successful call. An input the method writes
        (mutates) must not be a tensor that requires grad while grad mode is on
        (eager PyTorch refuses in-place writes to such a leaf): pass
        ``tensor.detach()`` or call under ``torch.no_grad()``. On error
        (``ValueError`` or ``TypeError`` naming the input, expected and actual)
        the method refuses to execute until a full set is installed. A tensor with a dim
        larger than the method's largest shape for it is refused (``ValueError``), and so is
        a decoder's call that breaks its runner contract (:class:`DecoderContract`).
        """
        self._check_sizes(inputs)
        self._native.set_inputs(inputs)

    def execute(self, inputs: Sequence[Any] | None = None, clone_outputs: bool = True) -> list[Any]:
        """Run once (installing ``inputs`` first if given) and return the outputs.

        Mutated inputs land in the caller's tensors. Raises ``ValueError`` if
        inputs were never set, if an input or bound output tensor's storage no
        longer holds its shape, or if a tensor the method writes requires grad
        in grad mode (nothing run); :class:`DelegateError` if a Python delegate
        raised; ``RuntimeError`` if the method is busy, or for any other
        runtime failure.
        """
        self._check_sizes(inputs)
        return list(self._native.call(inputs, clone_outputs))

    def get_outputs(self, clone_outputs: bool = True) -> list[Any]:
        """The outputs of the last call.

        With ``clone_outputs=True`` each unbound tensor output is a fresh copy,
        outputs that are inputs included. With ``False`` it aliases the
        runtime's memory (overwritten by the next call, kept alive by the
        tensor), or for an output that is an input, the caller's tensor's
        storage. A bound output is always the bound tensor itself, or a view of
        its front when a dynamic output is smaller.
        """
        return list(self._native.get_outputs(clone_outputs))

    def __call__(self, inputs: Sequence[Any], clone_outputs: bool = True) -> list[Any]:
        """``set_inputs(inputs)``, ``execute()``, ``get_outputs(clone_outputs)`` in one call."""
        self._check_sizes(inputs)
        return list(self._native.call(inputs, clone_outputs))

    def set_output(self, tensor: Any | None, index: int) -> None:
        """Bind output ``index`` to ``tensor`` (every later call writes straight into it),
        or unbind it with ``None`` (the runtime gives it storage again).

        The tensor must be a contiguous CPU tensor of the output's dtype, at
        least as large as the output's largest shape, whose storage holds it,
        sharing memory with no other bound output and no input, and not
        requiring grad while grad mode is on (eager PyTorch refuses ``out=``
        tensors that require grad). The output must not be memory planned,
        returned at more than one index, or be an input. Raises ``ValueError``
        naming expected and actual, changing nothing; ``IndexError`` for an
        index out of range. Tensors already returned uncloned stay valid.
        """
        self._native.set_output(tensor, index)


class Program:
    """A loaded program. ``load_method`` returns a fresh :class:`Method` each call.

    Loaded from bytes, it owns a copy of them. Loaded from a path, it keeps the
    file open and owns its plan and constants; each ``load_method`` maps the
    delegate data it needs from the file read-only while it loads (unmapped once
    the delegate has packed it, copied if the delegate keeps it), and refuses
    with :class:`ProgramError` if the file changed since ``load_program`` or was
    cut or changed during the load. A loaded method never reads the file again.
    """

    def __init__(self, native_program: Any) -> None:
        self._native = native_program
        # The plan is read from the program's own bytes (no copy): the
        # flatbuffer prefix, not the constant segments after it.
        data = memoryview(native_program)
        size = _pte.program_prefix_size(bytes(data[:32]))
        self._plan_source = data if size is None else data[:size]

    @property
    def method_names(self) -> set[str]:
        return set(self._native.method_names)

    def load_method(self, name: str) -> Method:
        """Load ``name`` with its own planned memory. Raises :class:`ProgramError`."""
        try:
            io = _pte.plan_io(self._plan_source, name)
            _pte.validate_plan(self._plan_source, name)
            written = list(_pte.written_inputs(self._plan_source, name))
        except ValueError as error:
            raise ProgramError(f"cannot load method {name!r}: {error}") from error
        repeats = [list(r) for r in io.output_repeats()]
        is_input = [-1 if j is None else j for j in io.output_is_input()]
        method = native().NativeMethod(self._native, name, is_input, repeats, written)
        contract = DecoderContract.of(self, method.metadata()["inputs"]) if name == "forward" else None
        return Method(method, contract)

    def constant_values(self, names: Sequence[str]) -> dict[str, int]:
        """The int each of ``names`` returns, for those that are methods of this program taking no
        input and returning one int (exir constant methods, such as the runner's metadata)."""
        found: dict[str, int] = {}
        for name in names:
            if name not in self.method_names:
                continue
            method = self.load_method(name)
            if method.metadata.num_inputs != 0:
                continue
            out = method.execute([])
            if len(out) == 1 and isinstance(out[0], int) and not isinstance(out[0], bool):
                found[name] = out[0]
        return found

    def metadata(self, name: str) -> MethodMetadata:
        """The metadata of method ``name`` (loads it)."""
        return self.load_method(name).metadata


def set_log_level(level: str) -> None:
    """The lowest level of ExecuTorch runtime log message printed to stderr, process-wide:
    ``"error"`` (the default: errors and fatal messages only), ``"info"`` or ``"debug"``.

    ``WRITEBACK_RUNTIME_LOG`` sets it when the runtime library loads. Below the level,
    messages are dropped where the runtime emits them (the runtime's log sink), so that
    ExecuTorch's informational lines (its threadpool reading CPU files) do not reach a
    user's terminal while errors still do.

    :raises ValueError: ``level`` is none of the three.
    """
    native().set_log_level(level)


class Runtime:
    """Loads programs, after registering the Python delegates a registry offers.

    ``Runtime.get()`` is the process's runtime; it asks
    ``load_registry().runtime_delegates()`` for delegates lazily, at the first
    ``load_program``, unless :meth:`register_delegates` was called with a
    registry first. Registrations are process-wide (ExecuTorch's backend
    registry is), and registering a backend id again replaces its delegate.
    """

    _instance: ClassVar[Runtime | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: Registry | None = None) -> None:
        self._registry = registry
        self._registered = False

    @classmethod
    def get(cls) -> Runtime:
        """The process's runtime."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def register_delegates(self, registry: Registry | None = None) -> dict[str, RuntimeDelegate]:
        """Register every delegate of ``registry`` (default: ``load_registry()``).

        :return: the delegates registered, keyed by backend id.
        :raises ValueError: a backend id is taken by a compiled ExecuTorch backend.
        """
        if registry is None:
            registry = self._registry
        if registry is None:
            from writeback_core.registry import load_registry

            registry = load_registry()
        delegates = registry.runtime_delegates()
        self.use_delegates(delegates)
        return delegates

    def use_delegates(self, delegates: Mapping[str, RuntimeDelegate]) -> None:
        """Register each of ``delegates`` (keyed by backend id, as a registry's
        ``runtime_delegates()`` returns them) that is not already the delegate
        registered under its id: a pipeline that loads program after program hands
        over the same delegates each time, and they are registered once.

        :raises ValueError: a backend id is taken by a compiled ExecuTorch backend.
        """
        registered = native().registered_delegates()
        for backend_id in sorted(delegates):
            if registered.get(backend_id) is not delegates[backend_id]:
                native().register_delegate(backend_id, delegates[backend_id])
        self._registered = True

    @property
    def backend_ids(self) -> list[str]:
        """Every backend the ExecuTorch runtime knows, compiled and Python."""
        return list(native().registered_backends())

    def load_program(
        self,
        data: bytes | bytearray | memoryview | str | os.PathLike[str],
        verification: Verification = Verification.InternalConsistency,
    ) -> Program:
        """Load a program from a ``.pte`` path or its bytes.

        From bytes, the program keeps its own copy. From a path, the plan and
        constants are read at once; delegate data is mapped when a method loads
        and unmapped once the delegate has packed it (so weights a delegate packs
        are not held twice, nor copied first). Change the file only after loading
        the methods you need, or pass its bytes to hold the whole program in
        memory.

        :param verification: :class:`Verification` (or a same-named member of
            executorch's ``Verification``); ``InternalConsistency`` checks the
            whole flatbuffer, so a corrupted file fails here, not later.
        :raises ProgramError: the data is not a loadable program.
        """
        if not self._registered:
            self.register_delegates()
        mode = Verification[getattr(verification, "name", str(verification))]
        if isinstance(data, (str, os.PathLike)):
            return Program(native().NativeProgram.from_path(os.fspath(data), int(mode)))
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data)
            source = view if view.c_contiguous else view.tobytes()
            return Program(native().NativeProgram.from_bytes(source, int(mode)))
        raise TypeError(f"load_program takes a path or bytes, got {type(data).__name__}")
