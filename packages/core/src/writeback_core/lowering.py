"""The one lowering path: every ``.pte`` writeback makes is made here. ``writeback run``,
``export``, ``bench`` and ``explain``, the fuzz oracle, the contract suite, the engine
targets, ``writeback_passes.to_executorch`` (a user's script) and the optimum recipe all call
these functions, so what the fuzzer certifies is byte for byte what users get.

1. :func:`partition`: ``to_edge_transform_and_lower`` with the chosen backend's
   partitioner (none: plain ``to_edge``) inside core's
   :class:`~writeback_core.partition.LoweringPartitioner`, which runs the registry's
   ``"exported"`` and ``"before_partition"`` passes for the backend and asks the registry per
   mutation (``writeback_accepts_in_place``); core records the decision.
2. :func:`to_executorch`: every pass any plugin registers through
   ``writeback_program_passes`` for that backend, at its stage (core orders and runs them:
   :func:`~writeback_core.program_passes.run_program_passes`), with :func:`backend_config`:
   mutated buffers that start non-zero keep their initial value, mutable buffers keep their
   names, graph inputs/outputs are memory planned as the :data:`MemoryPlan` says.
3. :func:`lower`: both steps, with what became of each mutation
   (:class:`~writeback_core.lowered.Lowered`).

exir is changed in named, visible places only, which :func:`partition` applies to every caller
alike: :func:`preprocess_shares_constants` while a delegate's ``preprocess`` runs,
:func:`~writeback_core.fusing.code_generated_once` while exir fuses the partitions, and
:func:`~writeback_core.edge_passes.edge_passes_pruned` while it builds the edge program (each
leaves the ``.pte`` byte for byte as it was).
Process housekeeping (dropping toolchain caches, returning freed memory) is no part of a
lowering: a command that wants it asks for it (``lower(..., between_steps=...)``).
"""

from __future__ import annotations

import copy
import enum
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from writeback_core.decompositions import decompositions_once
from writeback_core.edge_passes import edge_passes_pruned
from writeback_core.fusing import code_generated_once
from writeback_core.lowered import WEIGHTS_TAG, Lowered
from writeback_core.mutations import Mutation, find_mutations
from writeback_core.ops import schema_of
from writeback_core.program_passes import (
    as_exir_pass,
    own_tables,
    run_exported_passes,
    run_program_passes,
    unbacked_symbols_settled,
    write_back_bytes,
)
from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import InPlaceConflictError, InPlaceDecision, Registry, in_place_decisions, load_registry
from writeback_core.stored_once import store_named_data_once, stored_once
from writeback_core.types import BackendSpec, LoweringError, MemoryPlan, Stage

if TYPE_CHECKING:
    from executorch.exir import EdgeProgramManager, ExecutorchBackendConfig, ExecutorchProgramManager

    from writeback_core.types import ModelCase

__all__ = [
    "MEMORY_PLANS",
    "QUANTIZED_NAMESPACE",
    "WEIGHTS_TAG",
    "MemoryPlan",
    "Partitioned",
    "backend_config",
    "initialized_buffers",
    "load_quantized_kernels",
    "lower",
    "partition",
    "pass_names",
    "preprocess_shares_constants",
    "to_executorch",
]


# The node.meta["custom"] key XNNPACK reads to put a weight it serializes in a data file.
_DELEGATE_TAG_KEY = "delegate_constant_tag"


@dataclass
class Partitioned:
    """A program partitioned for a backend: the edge program and every in-place decision core
    recorded, keyed by target (including those of buffers that moved into a delegate, whose
    placeholders the edge program no longer has)."""

    edge: EdgeProgramManager
    decisions: dict[str, InPlaceDecision]
    mutations: list[Mutation]  # find_mutations of the edge program before any delegate took a write


def partition(
    program: ExportedProgram,
    registry: Registry | None,
    backend: BackendSpec | None,
    constant_methods: Mapping[str, Any] | None = None,
    *,
    weights_apart: bool = False,
) -> Partitioned:
    """``to_edge_transform_and_lower`` of ``program`` with ``backend``'s partitioner (none: no
    delegate) inside a :class:`~writeback_core.partition.LoweringPartitioner`, which runs the
    registry's ``"exported"`` passes for the backend on a copy of the program and its
    ``"before_partition"`` passes on the edge program, and records core's decision per
    mutation a partition touches. Delegates preprocess their partitions under
    :func:`preprocess_shares_constants` and the backend's ``lowering_context``.
    ``constant_methods`` (exir's: method name -> the constant it returns) are written beside
    ``forward``. With ``weights_apart``, every delegate files the weights it serializes under
    :data:`WEIGHTS_TAG` (:func:`to_executorch` with the same flag puts the program's own there).

    ``program`` is not changed. :raises LoweringError: naming the backend.
    """
    from executorch.exir import to_edge_transform_and_lower

    from writeback_core.partition import LoweringPartitioner, edge_arguments

    if backend is not None and registry is None:
        raise ValueError(f"backend {backend.name!r} needs a registry to ask per mutation")
    methods = dict(constant_methods) if constant_methods else None
    try:
        if backend is not None and registry is not None:
            # What writeback_core.to_edge_arguments() hands a user's own export script.
            arguments = edge_arguments(backend.name, backend.partitioner(registry), registry)
            if weights_apart:
                arguments["transform_passes"] = [_tag_weights_apart, *(arguments["transform_passes"] or [])]
            with ExitStack() as stack:
                stack.enter_context(known_warnings_ignored())
                stack.enter_context(preprocess_shares_constants())
                stack.enter_context(code_generated_once())
                stack.enter_context(edge_passes_pruned())
                if backend.single_decomposition:
                    stack.enter_context(decompositions_once(program, arguments["partitioner"]))
                stack.enter_context(unbacked_symbols_settled(program))
                if backend.lowering_context is not None:
                    stack.enter_context(backend.lowering_context())
                edge = to_edge_transform_and_lower(program, **arguments, constant_methods=methods)
            wrapped: LoweringPartitioner = arguments["partitioner"][0]
            mutations = wrapped.mutations
            decisions = {d.target: d for d in wrapped.decisions}
        else:
            # No delegate: the passes for no backend, at the same points, without a partitioner.
            own = run_exported_passes(program, registry, None) if registry else own_tables(program)
            transforms = (
                [as_exir_pass(p) for p in registry.program_passes("before_partition", None)] if registry else []
            )
            with known_warnings_ignored(), unbacked_symbols_settled(program), edge_passes_pruned():
                edge = to_edge_transform_and_lower(
                    own, transform_passes=transforms or None, partitioner=[], constant_methods=methods
                )
            mutations, decisions = find_mutations(edge.exported_program()), {}
    except InPlaceConflictError:
        raise  # the plugins' disagreement, named by core: not a failure of the lowering
    except Exception as error:
        name = backend.name if backend is not None else "none"
        raise LoweringError(f"partitioning for backend {name!r} failed: {type(error).__name__}: {error}") from error
    decisions.update(in_place_decisions(edge.exported_program()))
    return Partitioned(edge, decisions, mutations)


def _tag_weights_apart(graph_module: torch.fx.GraphModule) -> Any:
    """An edge transform: every placeholder carries XNNPACK's data-file tag (:data:`WEIGHTS_TAG`),
    so that a delegate files each weight it serializes there, quantized weights made by the
    edge decompositions included. A delegate reads the tag only of the constants it
    serializes, so inputs and state are unaffected."""
    from executorch.exir.pass_base import PassResult

    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            node.meta["custom"] = {**(node.meta.get("custom") or {}), _DELEGATE_TAG_KEY: WEIGHTS_TAG}
    return PassResult(graph_module, True)


def _weights_tag(_node: torch.fx.Node) -> str:
    """exir's ``external_constants`` answer: every program constant goes to :data:`WEIGHTS_TAG`."""
    return WEIGHTS_TAG


def _copy_sharing_constants(cls: type, edge_program: ExportedProgram, compile_specs: Any) -> ExportedProgram:
    """``edge_program`` deep-copied but for its weights and constants: the copy's graph,
    signature and tables are its own, its tensors are the program's."""
    shared = {
        id(tensor): tensor
        for table in (edge_program.state_dict, edge_program.constants)
        for tensor in table.values()
        if isinstance(tensor, torch.Tensor)
    }
    return copy.deepcopy(edge_program, shared)


@contextmanager
def preprocess_shares_constants() -> Iterator[None]:
    """While the block runs, a delegate's ``preprocess`` gets a copy of its partition that
    shares the partition's weights and constants (exir's default copy clones them). The one
    change writeback makes to exir; :func:`partition` applies it for every caller, and a
    user's own script that calls ``to_edge_transform_and_lower`` itself may wrap the call in
    it (the optimum recipe does).

    exir hands every backend that keeps its default ``copy_exported_program_for_preprocess``
    a deep copy of each partition, all made before the first ``preprocess`` runs: on a 0.5B
    decoder lowered to XNNPACK, a second copy of every delegated weight (1.97 GB) beside the
    serialized one, which set ``writeback run``'s peak (6.44 GB; 5.58 GB sharing them). The
    copy is there so that a backend may change its graph; a backend that changes a weight
    puts a new tensor in the table (XNNPACK's passes, writeback's backends) rather than
    writing into the old one, as ExecuTorch's CUDA backend says when it shares them the same
    way in its low-memory mode. A backend that defines its own copy keeps it. The ``.pte``
    is the same byte for byte with or without it. Process-wide while the block runs."""
    from executorch.exir.backend.backend_details import BackendDetails

    name = "copy_exported_program_for_preprocess"
    default = BackendDetails.__dict__.get(name)
    if default is None:  # an exir without the hook copies as it does
        yield
        return
    setattr(BackendDetails, name, classmethod(_copy_sharing_constants))
    try:
        yield
    finally:
        setattr(BackendDetails, name, default)


class _Backend(enum.Enum):
    """The default of :func:`to_executorch`'s ``backend``."""

    FROM_PROGRAM = "the backend the program was partitioned for"


@contextmanager
def _methods_settled(edge: EdgeProgramManager) -> Iterator[None]:
    """:func:`~writeback_core.program_passes.unbacked_symbols_settled` for every method of ``edge``."""
    with ExitStack() as stack:
        for method in edge.methods:
            stack.enter_context(unbacked_symbols_settled(edge.exported_program(method)))
        yield


def to_executorch(
    edge_manager: EdgeProgramManager,
    config: ExecutorchBackendConfig | None = None,
    registry: Registry | None = None,
    *,
    backend: str | _Backend | None = _Backend.FROM_PROGRAM,
    plan: MemoryPlan = "state",
    passes: bool = True,
    warn_copies: bool = True,
    weights_apart: bool = False,
) -> ExecutorchProgramManager:
    """``edge_manager.to_executorch(config)`` with every registered program pass for the
    backend added: the one ``to_executorch`` of writeback, the lowering path's and a user's
    script's (``writeback_passes.to_executorch`` is this function).

    Passes come from the ``writeback_program_passes`` hook of ``registry``
    (default: ``load_registry()``), those for ``backend``: the ``BackendSpec.name``
    ``edge_manager`` was partitioned for (``None``: no backend). By default it is read
    from ``edge_manager``: the backend core's in-place decisions name, else the installed
    backend whose delegates it calls (with no delegate: the one installed backend that
    has none, ``portable``), else ``None``. ``"edge"`` passes run first, in place on
    each method's edge program. ``"before_memory_planning"`` passes run inside
    exir after its write-back copies exist: after ``config.passes`` (the
    user's own, in their order), in the registry's order, and ``"after_out_variants"``
    passes after exir's out-variant pass (:func:`~writeback_core.program_passes.run_program_passes`).
    ``config`` itself is not changed; without one, :func:`backend_config` for ``plan``
    (named mutable buffers, the ``"state"`` memory plan by default), so that after
    ``to_edge_transform_and_lower(ep, **writeback_core.to_edge_arguments(backend))``
    the ``.pte`` is :func:`lower`'s, byte for byte. ``passes=False``: exir alone (no
    registry is read), the baseline a failure is triaged against.

    With ``warn_copies`` (the default), every mutated state the result still copies back
    whole is named, with its bytes per call, its cause and the line to add, in one
    :class:`~writeback_core.copies.CopyLeftWarning` per method (:func:`lower` reports them
    on its result instead).

    ``weights_apart`` (without a ``config``): the program's weights go to one data file,
    :data:`WEIGHTS_TAG` (:func:`backend_config`). Without it, a delegate's named data whose
    bytes equal a program constant's (a tied embedding/LM head) is read from the constant's
    bytes, stored once in the ``.pte``
    (:func:`~writeback_core.stored_once.store_named_data_once`; :func:`~writeback_core.stored_once.stored_once`
    says what).

    ``edge_manager`` is consumed (exir edits its signature).

    :raises TypeError: a registered pass returned something exir cannot use.
    """
    from writeback_core.copies import copies_left, warn_copies_left

    if passes and registry is None:
        registry = load_registry()
    decisions: dict[str, InPlaceDecision] = {}
    for method in edge_manager.methods:
        decisions.update(in_place_decisions(edge_manager.exported_program(method)))
    if config is None:
        load_quantized_kernels(edge_manager)
        config = backend_config(edge_manager, plan, weights_apart=weights_apart)
    if isinstance(backend, _Backend):
        backend = _backend_of(edge_manager, registry, decisions) if registry is not None else None
    with known_warnings_ignored(), _methods_settled(edge_manager):  # exir's notes that are harmless here
        if passes and registry is not None:
            program = run_program_passes(edge_manager, config, registry, backend)
        else:
            program = edge_manager.to_executorch(config)
        store_named_data_once(program, config)
    if warn_copies:
        for method in program.methods:
            warn_copies_left(copies_left(decisions, program.exported_program(method), backend), method)
    return program


def _backend_of(
    edge_manager: EdgeProgramManager, registry: Registry, decisions: Mapping[str, InPlaceDecision]
) -> str | None:
    """The backend ``edge_manager`` was partitioned for, as :func:`to_executorch` reads it."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    named = {decision.backend for decision in decisions.values()}
    if len(named) == 1:
        return named.pop()
    ids = {
        module.backend_id
        for method in edge_manager.methods
        for _, module, _ in get_lowered_submodules(edge_manager.exported_program(method).graph_module)
    }
    names = [
        spec.name
        for spec in registry.backends().values()
        if spec.backend_id in ids or (not ids and not spec.backend_id)
    ]
    return names[0] if len(names) == 1 else None


def lower(
    exported: ExportedProgram,
    registry: Registry | None,
    backend: BackendSpec | None = None,
    plan: MemoryPlan = "state",
    case: ModelCase | None = None,
    constant_methods: Mapping[str, Any] | None = None,
    *,
    partitioned: Partitioned | None = None,
    between_steps: Callable[[], None] | None = None,
    weights_apart: bool = False,
) -> Lowered:
    """Partition ``exported`` for ``backend`` (:func:`partition`), run the registry's passes
    for it and serialize (:func:`to_executorch`); ``registry`` None: exir alone, no passes.

    ``constant_methods`` (default: ``case``'s) are methods of the ``.pte`` returning a
    constant, exir's ``constant_methods``: ExecuTorch's LLM runner reads its metadata so.
    ``partitioned``: the partition step already done (its edge program is consumed; a
    harness that lowers one partition per memory plan passes a copy each time).
    ``between_steps`` is called once partitioning is done, before serialization: a command
    passes its housekeeping there (the app's ``return_freed_memory`` frees the
    partitioner's working copies before serialization copies the weights).
    ``weights_apart``: every weight, the program's and each delegate's, goes to one data file
    beside the ``.pte`` (:meth:`~writeback_core.lowered.Lowered.write_weights`), where bytes two
    weights share (a tied embedding and LM head) are stored once; a runtime loads the pair.

    ``exported`` is not changed. :raises LoweringError: a step failed; the message names it.
    """
    start = time.perf_counter()
    if constant_methods is None and case is not None:
        constant_methods = case.constant_methods
    if partitioned is None:
        partitioned = partition(exported, registry, backend, constant_methods, weights_apart=weights_apart)
    if between_steps is not None:
        between_steps()
    name = backend.name if backend is not None else None
    try:
        program = to_executorch(
            partitioned.edge,
            registry=registry,
            backend=name,
            plan=plan,
            passes=registry is not None,
            warn_copies=False,
            weights_apart=weights_apart,
        )
    except Exception as error:
        raise LoweringError(
            f"to_executorch (memory plan {plan!r}, passes {'on' if registry else 'off'}) failed: "
            f"{type(error).__name__}: {error}"
        ) from error
    final = program.exported_program()
    signature = final.graph_signature
    return Lowered(
        exported=exported,
        mutations=partitioned.mutations,
        decisions=partitioned.decisions,
        program=program,
        write_back_bytes=write_back_bytes(final),
        user_input_mutations=sum(1 for s in signature.output_specs if s.kind is OutputKind.USER_INPUT_MUTATION),
        backend=name,
        plan=plan,
        passes=pass_names(registry, name),
        seconds=time.perf_counter() - start,
        case=case,
        weights_apart=weights_apart,
        stored_once=stored_once(program),
    )


def pass_names(registry: Registry | None, backend: str | None) -> tuple[str, ...]:
    """Names of the program passes a lowering for ``backend`` (a ``BackendSpec.name``;
    ``None``: no backend) runs with ``registry``, stage by stage, in order."""
    if registry is None:
        return ()
    return tuple(p.name for stage in get_args(Stage) for p in registry.program_passes(stage, backend))


MEMORY_PLANS: Mapping[MemoryPlan, tuple[bool, bool]] = {
    "state": (False, True),
    "planned": (True, True),
    "unplanned": (False, False),
}


def initialized_buffers(program: ExportedProgram) -> list[str]:
    """Placeholder names of the mutated buffers whose initial value is not all zeros.

    The runtimes zero-fill a mutable buffer that carries no data, so only these need
    their value in the ``.pte``.
    """
    signature = program.graph_signature
    mutated = set(signature.buffers_to_mutate.values())
    found = []
    for placeholder, target in signature.inputs_to_buffers.items():
        if target not in mutated:
            continue
        value = program.state_dict.get(target, program.constants.get(target))
        if isinstance(value, torch.Tensor) and bool(value.ne(0).any()):
            found.append(placeholder)
    return found


def backend_config(
    edge: EdgeProgramManager, plan: MemoryPlan = "state", *, weights_apart: bool = False
) -> ExecutorchBackendConfig:
    """The ``ExecutorchBackendConfig`` writeback lowers with: named mutable buffers, non-zero
    initial values kept (:func:`initialized_buffers`), inputs/outputs planned per ``plan``;
    with ``weights_apart``, every program constant in the data file :data:`WEIGHTS_TAG`."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    if plan not in MEMORY_PLANS:
        raise ValueError(f"memory plan must be one of {sorted(MEMORY_PLANS)}, got {plan!r}")
    inputs, outputs = MEMORY_PLANS[plan]
    names = sorted({n for m in edge.methods for n in initialized_buffers(edge.exported_program(m))})
    return ExecutorchBackendConfig(
        emit_mutable_buffer_names=True,
        passes=[InitializedMutableBufferPass(names)] if names else [],
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=inputs, alloc_graph_output=outputs),
        external_constants=_weights_tag if weights_apart else False,
    )


# The namespace of PT2E's quantize/dequantize ops, whose out variants ExecuTorch ships in a
# library of its own (``executorch.kernels.quantized``), not loaded by ``import executorch``.
QUANTIZED_NAMESPACE = "quantized_decomposed"


def _quantized_ops(edge: EdgeProgramManager) -> list[str]:
    found = set()
    for method in edge.methods:
        for node in edge.exported_program(method).graph_module.graph.nodes:
            schema = schema_of(node.target) if node.op == "call_function" else None
            if schema is not None and schema.name.startswith(QUANTIZED_NAMESPACE + "::"):
                found.add(schema.name)
    return sorted(found)


def load_quantized_kernels(edge: EdgeProgramManager) -> list[str]:
    """Load ExecuTorch's quantized kernels when ``edge`` runs ``quantized_decomposed`` ops
    outside any delegate (a PT2E-quantized model on no backend): without them
    ``to_executorch`` stops at "Missing out variants". Returns the ops found (empty: nothing
    loaded).

    :raises LoweringError: the ops are there and the kernels cannot be loaded; the message
        names the ops and what to install.
    """
    found = _quantized_ops(edge)
    if not found:
        return found
    import importlib

    # Always loaded: a schema registered from Python (exir registers embedding_byte.out's) lets
    # to_executorch pass, but only the library registers the kernels the runtime runs.
    importlib.import_module("executorch.kernels.quantized")  # loads the library; logs, never raises
    if not _has_out_variant(found[0]):
        raise LoweringError(
            f"the program runs {', '.join(found)} outside any delegate, and ExecuTorch's quantized kernels "
            "(executorch.kernels.quantized, libquantized_ops_aot_lib) could not be loaded: install an executorch "
            "wheel that ships them, or lower to a backend that takes the quantized ops"
        )
    return found


def _has_out_variant(name: str) -> bool:
    """Whether an out variant (an overload named ``out`` or ``..._out``) of schema name
    ``namespace::op`` is registered."""
    schemas = torch._C._jit_get_schemas_for_operator(name)
    return any(s.overload_name == "out" or s.overload_name.endswith("_out") for s in schemas)
