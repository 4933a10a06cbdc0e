"""Every hook of writeback. Plugins implement these with ``@writeback_core.hookimpl``.

A plugin is any object or module with ``writeback_*`` functions; third parties
register one through the ``writeback`` entry-point group. Hookimpls must not
declare parameters with defaults (pluggy does not pass them) and may take any
subset of a hook's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import pluggy

from writeback_core._name import NAME

if TYPE_CHECKING:
    import click
    from executorch.exir import EdgeProgramManager, ExecutorchProgramManager
    from torch.export import ExportedProgram

    from writeback_core.mutations import Mutation
    from writeback_core.registry import Registry
    from writeback_core.types import (
        AliasingEngine,
        BackendSpec,
        ModelCase,
        PartitionView,
        ProgramPass,
        RuntimeDelegate,
        RuntimeSpec,
        Stage,
        StateAllocator,
    )

hookspec = pluggy.HookspecMarker(NAME)


@hookspec
def writeback_backends() -> Sequence[BackendSpec]:
    """Called when the registry lists backends (``Registry.backends()``, ``--backend``).

    :return: the backends this plugin offers; an empty sequence for none. Two
        plugins offering one backend name is an error naming both.
    """
    raise NotImplementedError


@hookspec
def writeback_accepts_in_place(backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
    """Called per mutation that a partition of ``backend`` touches, while partitioning (and,
    for a backend whose ``BackendSpec.kernel_writes`` is set, per mutation no partition
    touches, with ``partition.kernels`` True: the view of the operators outside every
    partition).

    Every plugin is asked (this is not ``firstresult``); core gathers the answers,
    records the decision on the mutated placeholder under
    ``writeback_core.meta.IN_PLACE`` and raises, naming both plugins, when one
    says ``True`` and another ``False``.

    :param backend: the name of the backend whose partitioner asks.
    :param partition: the nodes that partition takes.
    :param mutation: one write to a buffer or user input, with its write shape.
    :return: ``True`` if the backend writes this mutation in place (its write-back
        copy may be dropped), ``False`` if it must be copied back, ``None`` for no
        opinion (for example, a plugin that knows nothing of ``backend``).
    """
    raise NotImplementedError


@hookspec
def writeback_program_passes(stage: Stage) -> Sequence[ProgramPass]:
    """Called when the pipeline assembles the passes of one stage of its lowering.

    Core keeps the passes whose ``backends`` admit the backend being lowered for and orders
    them by their ``after``/``before`` relations, ties broken by name
    (``Registry.program_passes``); a cycle, two passes of one name, or a relation naming no
    offered pass of the stage that the pass does not mark ``optional``, is an error naming
    the passes and their plugins. Each pass says the backends it serves (``backends``) and
    why (``reason``): ``writeback run`` and ``writeback explain`` print both.

    :param stage: ``"exported"``, ``"before_partition"``, ``"edge"``, ``"before_memory_planning"`` or
        ``"after_out_variants"`` (see
        ``writeback_core.types.Stage``).
    :return: the passes this plugin runs at that stage, for any backend; empty for none.
    """
    raise NotImplementedError


@hookspec
def writeback_runtime_delegates() -> Sequence[RuntimeDelegate]:
    """Called by a runtime before loading programs, to register Python delegates.

    :return: delegate objects, each with a unique ``backend_id``; empty for none.
        Two plugins offering one ``backend_id`` is an error naming both.
    """
    raise NotImplementedError


@hookspec
def writeback_engines() -> Sequence[AliasingEngine]:
    """Called when a pipeline looks for engines that alias only some writes (TensorRT-like).

    Such an engine writes a state update in place only when its rule allows
    (for TensorRT: a cache-shaped write) and recomputes the rest, which the
    program must then copy back. The pipeline asks the engine's predicate per
    write before lowering, and after lowering reads what the engine really
    aliased, to check the two agree.

    :return: engine objects (``writeback_core.types.AliasingEngine``), each with
        a unique ``name``; an empty sequence for none. Two plugins offering one
        name is an error naming both.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def writeback_lower_for_engine(engine: AliasingEngine, program: ExportedProgram) -> EdgeProgramManager | str | None:
    """Called when a pipeline lowers a program to an engine that aliases only some writes
    (the fuzz oracle's engine targets do, once per program and engine).

    The plugin that owns ``engine`` runs its copy-back path: every mutated
    buffer ends up either written in place by the engine or copied back by the
    program, checked against what the engine really aliased.

    Stops at the first non-None result: the plugin owning ``engine`` answers,
    every other plugin returns ``None``.

    :param engine: one of the engines offered through ``writeback_engines``.
    :param program: the program as ``torch.export`` made it (aten dialect); the
        implementation must not change it.
    :return: the lowered edge program (an ``EdgeProgramManager``, ready for
        ``to_executorch``, which returns what the model returns and declares every
        buffer it writes); or a ``str``, the reason ``engine`` cannot take this
        program (an op or argument it does not support, a documented limit),
        which callers report as a skip, never as a pass; ``None`` when this plugin
        does not own ``engine``. Any exception is a failure of the path.
    """
    raise NotImplementedError


@hookspec
def writeback_models() -> dict[str, ModelCase]:
    """Called when the CLI resolves a model name (``writeback explain NAME``).

    :return: built-in style models keyed by name; empty for none. Two plugins
        offering one name is an error naming both.
    """
    raise NotImplementedError


@hookspec
def writeback_model_from_path(path: str, accept_weights: bool) -> ModelCase | None:
    """Called when a command is given a model that names an existing file or folder
    (``writeback export path/to/hf-folder``) and no built-in model has that name.

    :param path: the path as the user typed it; the plugin reads it as data only
        (nothing in it may become code).
    :param accept_weights: the user passed ``--accept-weights``: weights that do not give
        the model's numbers (tensors missing, unexpected, of a dtype that does not convert
        exactly, non-finite) are loaded as they are instead of refused; the case's
        description says what was accepted. ``False``: refuse them (``ValueError``).
    :return: the model the path holds, when the plugin recognizes it (a Hugging Face
        model folder, say); ``None`` when it does not. Two plugins both recognizing one
        path is an error naming both.
    """
    raise NotImplementedError


@hookspec
def writeback_explain_columns(program: ExportedProgram, mutation: Mutation) -> dict[str, str] | None:
    """Called by ``writeback explain`` once per mutation row.

    :param program: the exported (aten) program being explained.
    :param mutation: the row's mutation, found in
        :func:`writeback_core.program_passes.decomposed` ``(program)``: its node names are
        that shared decomposition's (read it there rather than decompose again).
    :return: extra columns for the row, keyed by column title; ``None`` for none.
    """
    raise NotImplementedError


@hookspec
def writeback_explain_notes(
    program: ExportedProgram, registry: Registry, lower: Callable[[str], ExecutorchProgramManager]
) -> Sequence[str] | None:
    """Called once by ``writeback explain``, after the table: facts about the whole program
    rather than one state (how a backend's delegate will execute it, say).

    :param program: the exported (aten) program being explained; not to be changed.
    :param registry: the registry explain runs with.
    :param lower: ``lower(backend_name)`` lowers ``program`` for that backend exactly as
        ``writeback run`` would and returns exir's program manager (so a plugin sees the
        delegate blobs a run ships without importing the application); it raises what the
        lowering raises.
    :return: lines printed under the table, each a sentence; ``None`` or empty for none.
    """
    raise NotImplementedError


@hookspec
def writeback_cli_commands(group: click.Group) -> None:
    """Called once when the ``writeback`` CLI starts, to add subcommands.

    :param group: the root ``click`` group; call ``group.add_command(...)``.
    :return: ``None``; plugins add commands to ``group`` and any result is ignored.
    """
    raise NotImplementedError


@hookspec
def writeback_runtimes() -> Sequence[RuntimeSpec]:
    """Called when a pipeline needs a runtime to execute a ``.pte`` (``writeback run --runtime``).

    :return: the runtimes this plugin offers (``writeback_core.types.RuntimeSpec``:
        a name and a ``load_program(data, delegates)`` callable); an empty
        sequence for none. Two plugins offering one name is an error naming both.
    """
    raise NotImplementedError


@hookspec
def writeback_state_allocators() -> Mapping[str, StateAllocator]:
    """Called when a pipeline allocates caller-owned state (a KV cache passed as an input)
    for a program lowered to some backend.

    A backend whose delegate reads caller memory without copying only when it
    allocated that memory itself (MLX on Linux) offers its allocator here; the
    pipeline then allocates the state with it and binds it in place.

    :return: allocators keyed by backend name (``BackendSpec.name``); each
        ``allocator(shape, dtype)`` returns a zero-filled contiguous CPU
        ``torch.Tensor``. Empty for none: the pipeline then uses ``torch.zeros``.
        Two plugins offering an allocator for one backend is an error naming both.
    """
    raise NotImplementedError
