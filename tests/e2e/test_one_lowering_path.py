"""The fuzzer certifies what users get: `writeback run` and the fuzz oracle (and the contract
suite) lower through one path, so the .pte `run` writes and the one the oracle runs for the
same program are byte for byte the same. Real CLI, real plugins, real exir."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner
from writeback.cli import main
from writeback.zoo import builtin_models
from writeback_core.registry import load_registry
from writeback_testing.lowered_plans import Lowerings
from writeback_testing.oracle import built_from_case

from tests.conftest import Decomposition


@pytest.mark.parametrize(
    ("model", "backend"),
    [("ema", "none"), ("decoder-caller-cache", "mlx"), pytest.param("decoder", "mlx", marks=pytest.mark.slow)],
)
def test_run_writes_byte_for_byte_the_pte_the_oracle_checks(tmp_path: Path, model: str, backend: str) -> None:
    pte = tmp_path / f"{model}.pte"
    result = CliRunner().invoke(main, ["run", model, "--backend", backend, "--steps", "1", "--output", str(pte)])
    assert result.exit_code == 0, result.output
    registry = load_registry()
    spec = None if backend == "none" else registry.backends()[backend]
    oracle = Lowerings(built_from_case(builtin_models()[model]), registry, backend=spec)
    checked = oracle.pte("state")
    written = pte.read_bytes()
    assert len(written) == len(checked), f"run wrote {len(written)} bytes, the oracle checks {len(checked)}"
    assert written == checked


def test_the_oracle_without_passes_lowers_a_different_program(tmp_path: Path) -> None:
    """The comparison above can fail: the same model lowered without writeback's passes
    (the oracle's triage baseline) keeps its write-back copies, so its bytes differ."""
    pte = tmp_path / "decoder.pte"
    result = CliRunner().invoke(main, ["run", "decoder-caller-cache", "--steps", "1", "--output", str(pte)])
    assert result.exit_code == 0, result.output
    registry = load_registry()
    case = builtin_models()["decoder-caller-cache"]
    bare = Lowerings(built_from_case(case), registry, with_passes=False, backend=registry.backends()["mlx"])
    assert bare.lowered("state").write_back_bytes, "without passes the cache write-backs stay"
    assert pte.read_bytes() != bare.pte("state")


@pytest.mark.parametrize(
    "how", [{"strict": True}, {"step_kwargs": lambda step: {"scale": 2.0}}, {"dynamic_shapes": {"x": {}}}]
)
def test_the_oracle_refuses_a_case_exported_its_own_way_rather_than_check_another_program(
    how: dict[str, object],
) -> None:
    """The oracle exports positionally and non-strict; a case that says otherwise would be
    certified as a program no command ships."""
    case = dataclasses.replace(builtin_models()["ema"], **how)  # type: ignore[arg-type]  # each field's own type
    with pytest.raises(ValueError, match="model 'ema' says how it is exported"):
        built_from_case(case)


@pytest.mark.parametrize(("backend", "xnnpack"), [("xnnpack", True), ("none", False)])
def test_lower_decomposes_the_models_graph_no_more_often_than_stock_lowering_and_once_on_xnnpack(
    decompositions: list[Decomposition], backend: str, xnnpack: bool
) -> None:
    """A decomposition of the whole graph is the costliest step of a lowering at real size:
    ``lower`` runs as many as ExecuTorch's own ``to_edge_transform_and_lower`` +
    ``to_executorch`` of the same program (its mutations are read from the edge program
    the partitioner gets, not from a decomposition of its own), and on XNNPACK, whose
    backend declares ``single_decomposition``, one: exir's idle retraces are skipped."""
    from writeback.model_build import export_case
    from writeback.session import assemble
    from writeback_bench.contenders import stock_program
    from writeback_core.lowering import lower

    case = builtin_models()["decoder"]
    exported = export_case(case)
    size = len(exported.graph.nodes)

    def of_the_model() -> int:  # the model's graph, not a backend's small pattern graphs
        return sum(1 for d in decompositions if d.nodes >= size // 2)

    stock_program(exported, xnnpack=xnnpack)
    stock = of_the_model()
    decompositions.clear()
    pipeline = assemble(load_registry(), backend)
    lowered = lower(exported, pipeline.registry, pipeline.backend, "state", case)
    assert stock >= 1
    wanted = 1 if xnnpack else stock
    assert of_the_model() == wanted, f"writeback decomposed the graph {of_the_model()} times, stock {stock}"
    assert {m.target for m in lowered.mutations} == {"blocks.0.k_cache", "blocks.0.v_cache"}
