"""The blob fuzzer's seeds (step 1 of :mod:`writeback_testing.blobfuzz`): the small real
programs it starts from (:data:`SEED_PROGRAMS`), lowered for each target a registry offers
(``pte``, ``backend:NAME``, ``engine:NAME``: :func:`targets_of`), each kept as a
:class:`Seed` (a delegate call's blob, compile specs, the tensors it receives and eager
PyTorch's answer; or a ``.pte`` with its inputs and eager's outputs), built once per process
(:func:`seeds_of`); and the plugins the fuzzer loads (:data:`DEFAULT_PLUGINS`,
:func:`installed_plugins`, :func:`registry_of`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_PLUGINS",
    "SEED_PROGRAMS",
    "Seed",
    "build_seeds",
    "installed_plugins",
    "registry_of",
    "seeds_of",
    "targets_of",
]

# The plugins whose backends, engines and runtime the fuzzer reaches (by module name,
# so a sibling plugin in progress does not change what CI fuzzes).
DEFAULT_PLUGINS = (
    "writeback_passes.plugin",
    "writeback_pybind_runtime.plugin",
    "writeback_trt_copyback.plugin",
    "writeback_mlx_backend.plugin",
    "writeback_example_backend.plugin",
)


def installed_plugins() -> tuple[str, ...]:
    """The modules of :data:`DEFAULT_PLUGINS` that are installed (a package may be absent)."""
    import importlib.util

    def found(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its package is not installed
            return False

    return tuple(m for m in DEFAULT_PLUGINS if found(m))


def registry_of(plugins: Sequence[str]) -> Any:
    """A registry of ``plugins`` (module names) alone: no entry points are loaded."""
    import importlib

    from writeback_core.registry import load_registry

    return load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in plugins])


def _seed_programs() -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Small real programs with state, and example inputs (fixed weights: seeds repeat)."""
    import torch

    class CacheWrite(torch.nn.Module):
        """A decoder step's state write: new rows into a cache at a position, then reads of it."""

        cache: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, 2, 8, 4))
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, pos: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.cache.index_copy_(2, pos, self.proj(x))
            return torch.softmax(self.cache.sum(-1), -1), self.cache[:, :, :4].transpose(1, 2).reshape(1, 4, 8)

    class Mixed(torch.nn.Module):
        """Embedding, cat, slice, where, cumsum, flip and matmul around a running state."""

        state: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(6, 4)
            self.register_buffer("state", torch.zeros(3, 4))

        def forward(self, tok: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.cat([self.emb(tok), x], 0)[1:4] * 2
            self.state.copy_(torch.where(h > 0, h, self.state) + self.state.cumsum(0))
            return h @ self.state.t(), self.state.flip(0)

    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cache_write, mixed = CacheWrite().eval(), Mixed().eval()
    return {
        "cache-write": (cache_write, (torch.tensor([5]), torch.randn(1, 2, 1, 4, generator=generator))),
        "mixed": (mixed, (torch.tensor([1, 4, 2]), torch.randn(3, 4, generator=generator))),
    }


SEED_PROGRAMS = ("cache-write", "mixed")


@dataclass
class Seed:
    """A real blob (or ``.pte``) with the call it was made for.

    ``args`` are what the delegate's ``execute`` receives (its inputs, then its
    outputs, filled with a sentinel so an unwritten one shows); ``expected`` is
    eager's answer, one tensor per output. For the ``pte`` target ``blob`` is the
    program and ``args`` the method's inputs.
    """

    target: str
    program: str
    blob: bytes
    specs: dict[str, bytes]
    args: list[Any]
    num_inputs: int
    expected: list[Any]
    backend_id: str = ""


def _export(module: Any, args: tuple[Any, ...]) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args, strict=False)


def _state_values(program: Any, user_inputs: Sequence[Any]) -> list[Any]:
    """The placeholder values of an edge program: its parameters, buffers and constants
    (cloned), then ``user_inputs``, in the signature's order."""
    from torch.export.graph_signature import InputKind

    user = iter(user_inputs)
    values: list[Any] = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            values.append(next(user))
        elif spec.target in program.state_dict:
            values.append(program.state_dict[spec.target].clone())
        else:
            values.append(program.constants[spec.target].clone())
    return values


def _delegate_seeds(target: str, name: str, edge_program: Any, inputs: Sequence[Any]) -> list[Seed]:
    """One seed per delegate call of ``edge_program``: its blob and specs, the values it
    receives and eager's answer, recorded while exir runs the program eagerly."""
    import torch
    from executorch.exir.delegate import executorch_call_delegate

    seeds: list[Seed] = []

    class _Recorder(torch.fx.Interpreter):
        def call_function(self, target_fn: Any, args: Any, kwargs: Any) -> Any:
            result = super().call_function(target_fn, args, kwargs)
            if target_fn is executorch_call_delegate:
                lowered = args[0]
                outputs = list(result) if isinstance(result, (tuple, list)) else [result]
                received = [a.clone() if isinstance(a, torch.Tensor) else a for a in args[1:]]
                sentinels = [torch.full_like(o, -7) for o in outputs]
                seeds.append(
                    Seed(
                        target=target,
                        program=f"{name}#{len(seeds)}",
                        blob=bytes(lowered.processed_bytes),
                        specs={s.key: bytes(s.value) for s in lowered.compile_specs},
                        args=[*received, *sentinels],
                        num_inputs=len(received),
                        expected=[o.clone() for o in outputs],
                        backend_id=str(lowered.backend_id),
                    )
                )
            return result

    with torch.no_grad():
        _Recorder(edge_program.graph_module).run(*_state_values(edge_program, inputs))
    return seeds


def build_seeds(registry: Any, target: str) -> list[Seed]:
    """The seeds of ``target``: ``pte``, ``backend:NAME`` or ``engine:NAME`` of ``registry``.

    :raises ValueError: the registry offers no such backend or engine.
    """
    import torch
    from writeback_core.lowering import lower, partition
    from writeback_core.quiet import known_warnings_ignored

    seeds: list[Seed] = []
    kind, _, name = target.partition(":")
    for program_name, (module, inputs) in _seed_programs().items():
        exported = _export(module, inputs)
        with known_warnings_ignored():
            if kind == "pte":
                lowered = lower(exported, registry, None)
                state = copy.deepcopy(module)
                with torch.no_grad():
                    expected = state(*[i.clone() for i in inputs])
                outs = list(expected) if isinstance(expected, tuple) else [expected]
                seeds.append(Seed(target, program_name, lowered.pte, {}, list(inputs), len(inputs), outs))
            elif kind == "backend":
                backends = registry.backends()
                if name not in backends:
                    raise ValueError(f"no backend {name!r} in the registry; it has {sorted(backends)}")
                edge = partition(exported, registry, backends[name]).edge
                seeds.extend(_delegate_seeds(target, program_name, edge.exported_program(), inputs))
            elif kind == "engine":
                engines = registry.engines()
                if name not in engines:
                    raise ValueError(f"no engine {name!r} in the registry; it has {sorted(engines)}")
                edge = registry.hook.writeback_lower_for_engine(engine=engines[name], program=exported)
                if not isinstance(edge, str) and edge is not None:
                    seeds.extend(_delegate_seeds(target, program_name, edge.exported_program(), inputs))
            else:
                raise ValueError(f"unknown target {target!r}: expected pte, backend:NAME or engine:NAME")
    return seeds


# Seeds built in this process, by (plugins, target): see seeds_of.
_SEEDS: dict[tuple[tuple[str, ...], str], list[Seed]] = {}


def seeds_of(target: str, plugins: Sequence[str] = DEFAULT_PLUGINS) -> list[Seed]:
    """:func:`build_seeds` of ``target`` with a registry of ``plugins``, built once per process
    (seeds are deterministic: fixed weights and inputs); each call returns its own copy.

    :raises ValueError: as :func:`build_seeds`.
    """
    key = (tuple(plugins), target)
    if key not in _SEEDS:
        _SEEDS[key] = build_seeds(registry_of(plugins), target)
    return copy.deepcopy(_SEEDS[key])


def targets_of(registry: Any) -> list[str]:
    """Every target ``registry`` offers: ``pte`` (when it offers a runtime), each backend
    with a Python runtime delegate (a compiled one, such as XNNPACK, has no blob reader
    here to fuzz), each aliasing engine."""
    found = ["pte"] if registry.runtimes() else []
    delegates = registry.runtime_delegates()
    found += [f"backend:{n}" for n, b in sorted(registry.backends().items()) if b.backend_id in delegates]
    found += [f"engine:{n}" for n in sorted(registry.engines())]
    return found
