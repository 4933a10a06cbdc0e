"""writeback in the export script users already have: ExecuTorch's idiom
(``torch.export`` -> ``to_edge_transform_and_lower(ep, partitioner=[...])`` -> ``to_executorch``)
with two lines changed writes ``lower()``'s ``.pte`` byte for byte; every half-way script that
leaves a whole-state copy warns, naming each buffer. Real torch.export, exir, plugins."""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import writeback_passes
from executorch.exir import to_edge_transform_and_lower
from writeback.model_build import export_case
from writeback.zoo import builtin_models
from writeback_core import CopyLeftWarning, Mutation, PartitionView, hookimpl, load_registry, to_edge_arguments
from writeback_core.lowering import lower
from writeback_core.types import ModelCase


def _idiom_bytes(case: ModelCase, backend: str, partitioner: Any = None, edge: Any = None) -> bytes:
    """A user's script with writeback's two lines: the arguments of to_edge, and to_executorch
    (of ``edge`` when given: that script's edge program, which to_executorch changes)."""
    if edge is None:
        edge = to_edge_transform_and_lower(
            export_case(case),
            **to_edge_arguments(backend, partitioner),
            constant_methods=dict(case.constant_methods) or None,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CopyLeftWarning)  # the refusals lower() also keeps
        return bytes(writeback_passes.to_executorch(edge).buffer)


def _lower_bytes(case: ModelCase, backend: str) -> bytes:
    registry = load_registry()
    return lower(export_case(case), registry, registry.backends()[backend], case=case).pte


@functools.cache
def _zoo_lower_bytes(model: str, backend: str) -> bytes:
    """lower()'s ``.pte`` of a zoo model, made once per process (bytes: nothing can change it)."""
    return _lower_bytes(builtin_models()[model], backend)


@functools.cache
def _zoo_idiom(model: str, backend: str) -> tuple[Any, tuple[str, dict[str, Any]], Any]:
    """A zoo model exported, its program as it was before the idiom's to_edge (graph, state),
    and that edge program, made once per process: a test takes a copy of the edge program
    (to_executorch changes it)."""
    case = builtin_models()[model]
    ep = export_case(case)
    before = str(ep.graph_module.graph), dict(ep.state_dict)
    edge = to_edge_transform_and_lower(
        ep, **to_edge_arguments(backend), constant_methods=dict(case.constant_methods) or None
    )
    return ep, before, edge


@pytest.fixture(scope="module")
def bare_xnnpack_edge() -> Any:
    """The decoder through ExecuTorch's bare XnnpackPartitioner (each test takes a copy)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return to_edge_transform_and_lower(export_case(builtin_models()["decoder"]), partitioner=[XnnpackPartitioner()])


# Each backend with each kind of cache once in the fast tier; the other two pairs in the slow tier.
@pytest.mark.parametrize(
    ("model", "backend"),
    [
        ("decoder", "xnnpack"),
        ("decoder-caller-cache", "mlx"),
        pytest.param("decoder-caller-cache", "xnnpack", marks=pytest.mark.slow),
        pytest.param("decoder", "mlx", marks=pytest.mark.slow),
    ],
)
def test_the_two_line_idiom_writes_lowers_bytes(model: str, backend: str) -> None:
    edge = copy.deepcopy(_zoo_idiom(model, backend)[2])
    assert _idiom_bytes(builtin_models()[model], backend, edge=edge) == _zoo_lower_bytes(model, backend)


def test_executorchs_own_xnnpack_partitioner_wrapped_writes_lowers_bytes() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    case = builtin_models()["decoder"]
    assert _idiom_bytes(case, "xnnpack", XnnpackPartitioner()) == _zoo_lower_bytes("decoder", "xnnpack")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "mlx"])
def test_the_two_line_idiom_writes_lowers_bytes_for_a_hugging_face_llama_folder(tmp_path: Path, backend: str) -> None:
    from transformers import AutoModelForCausalLM
    from writeback_decoders import hf_case, hf_config

    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(hf_config("llama")).eval().save_pretrained(tmp_path)
    case = hf_case(tmp_path, max_cache_len=16)
    assert _idiom_bytes(case, backend) == _lower_bytes(case, backend)


def test_the_idiom_leaves_the_callers_program_unchanged() -> None:
    ep, before, _ = _zoo_idiom("decoder", "xnnpack")  # before: as it was before to_edge_transform_and_lower
    assert (str(ep.graph_module.graph), dict(ep.state_dict)) == before


def test_to_edge_arguments_refuses_an_unknown_backend_naming_those_installed() -> None:
    with pytest.raises(ValueError, match=r"no backend named 'tpu' is installed \(installed: .*xnnpack"):
        to_edge_arguments("tpu")


def test_to_edge_arguments_refuses_what_is_not_a_partitioner() -> None:
    with pytest.raises(TypeError, match=r"wraps an executorch\.exir\.backend\.partitioner\.Partitioner, got str"):
        to_edge_arguments("xnnpack", "XnnpackPartitioner")


def _copy_warnings(action: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if issubclass(w.category, CopyLeftWarning)]


def _cache_names(case: ModelCase) -> list[str]:
    module = case.build()
    return [name for name, _ in module.named_buffers() if "cache" in name]


def test_an_unwrapped_partitioner_warns_naming_every_cache_left_copied(bare_xnnpack_edge: Any) -> None:
    """ExecuTorch's bare XnnpackPartitioner, then writeback's to_executorch: nothing recorded
    an in-place decision, so every cache keeps its copy; one warning names each."""
    case = builtin_models()["decoder"]
    edge = copy.deepcopy(bare_xnnpack_edge)
    messages = _copy_warnings(lambda: writeback_passes.to_executorch(edge))
    assert len(messages) == 1, messages
    caches = _cache_names(case)
    assert caches
    for name in caches:
        assert f"buffer {name!r} (" in messages[0]
    assert "no in-place decision was recorded" in messages[0]
    assert "to_edge_arguments(" in messages[0]


def test_the_wrapped_idiom_on_the_stock_runtime_kernels_does_not_warn() -> None:
    """portable: every write runs on the runtime's kernels and is made in place: nothing to say."""
    case = builtin_models()["decoder"]
    edge = to_edge_transform_and_lower(export_case(case), **to_edge_arguments("portable"))
    assert _copy_warnings(lambda: writeback_passes.to_executorch(edge)) == []


def test_a_bare_mlx_partitioner_warns_at_partition_naming_every_caller_cache() -> None:
    """MLXPartitioner used as upstream users write it: it says, before exir's own to_executorch
    ever runs, that every state it touches will be copied back, and what to write instead."""
    from writeback_mlx_backend import MLXPartitioner

    case = builtin_models()["decoder-caller-cache"]
    ep = export_case(case)
    messages = _copy_warnings(lambda: to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()]).to_executorch())
    assert len(messages) == 1, messages
    assert "MLXPartitioner() used alone" in messages[0]
    for name in ep.graph_signature.user_inputs_to_mutate.values():
        assert repr(name) in messages[0]
    assert "to_edge_arguments('mlx')" in messages[0]


def test_a_bare_mlx_partitioner_inside_writebacks_idiom_does_not_warn() -> None:
    from writeback_mlx_backend import MLXPartitioner

    case = builtin_models()["decoder-caller-cache"]
    edge = to_edge_transform_and_lower(export_case(case), **to_edge_arguments("mlx", MLXPartitioner()))
    assert _copy_warnings(lambda: writeback_passes.to_executorch(edge)) == []


def test_the_copy_warning_is_silenced_by_the_standard_filter(bare_xnnpack_edge: Any) -> None:
    edge = copy.deepcopy(bare_xnnpack_edge)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=CopyLeftWarning)
        writeback_passes.to_executorch(edge)
    assert not [w for w in caught if issubclass(w.category, CopyLeftWarning)]


@pytest.mark.slow
def test_run_says_which_runtime_loads_an_mlx_pte_and_that_runtime_does_in_a_fresh_process(tmp_path: Path) -> None:
    """`writeback run --backend mlx --output` names the runtime that loads the file; in a fresh
    process ExecuTorch's stock runtime refuses it and writeback's runtime runs it."""
    import subprocess
    import sys

    from click.testing import CliRunner
    from writeback.cli import main

    pte = tmp_path / "decoder.pte"
    result = CliRunner().invoke(main, ["run", "decoder", "--backend", "mlx", "--steps", "1", "--output", str(pte)])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "needs writeback's runtime: writeback_pybind_runtime.Runtime.get().load_program(" in flat
    stock = f"from executorch.runtime import Runtime\nRuntime.get().load_program({str(pte)!r}).load_method('forward')\n"
    refused = subprocess.run([sys.executable, "-c", stock], capture_output=True, text=True)
    assert refused.returncode != 0
    assert "not registered" in refused.stdout + refused.stderr or "0x20" in refused.stdout + refused.stderr
    ours = (
        "from writeback_pybind_runtime import Runtime\n"
        f"Runtime.get().load_program({str(pte)!r}).load_method('forward')\n"
        "print('loaded')\n"
    )
    loaded = subprocess.run([sys.executable, "-c", ours], capture_output=True, text=True)
    assert loaded.returncode == 0 and "loaded" in loaded.stdout, loaded.stderr[-2000:]


class _DeclineMLX:
    """A plugin that declines every mutation of the mlx backend (and none other answers)."""

    writeback_name = "decline-mlx"

    @hookimpl
    def writeback_accepts_in_place(self, backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
        return False if backend == "mlx" else None


def test_a_plugins_refusal_is_named_in_the_copy_warning() -> None:
    from writeback_core.partition import edge_arguments
    from writeback_mlx_backend import MLXPartitioner

    registry = load_registry(entry_points=False, plugins=[_DeclineMLX()])
    case = builtin_models()["decoder-caller-cache"]
    edge = to_edge_transform_and_lower(export_case(case), **edge_arguments("mlx", MLXPartitioner(), registry))
    messages = _copy_warnings(lambda: writeback_passes.to_executorch(edge, registry=registry))
    assert len(messages) == 1, messages
    for name in ("caches_0", "caches_1"):
        assert (
            f"input {name!r} (2048 bytes): plugin 'decline-mlx' declined to write it in place for backend 'mlx'"
            in (messages[0])
        )


def test_run_names_the_cause_of_each_copy_left() -> None:
    """`writeback run --backend none`: no backend decided, and the line says so."""
    from click.testing import CliRunner
    from writeback.cli import main

    result = CliRunner().invoke(main, ["run", "decoder", "--backend", "none", "--steps", "1"])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    for name in ("blocks.0.k_cache", "blocks.0.v_cache"):
        assert f"{name} (2.0 KiB): program buffer; whole-state copy left (2.0 KiB/call): no backend was chosen" in flat
