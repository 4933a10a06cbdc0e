"""A model computing an op outside Core ATen with no decomposition into it (``torch.histc``, as a
mixture-of-experts router counting tokens per expert) is refused by every command that exports it,
exit 2, one paragraph naming the model, the op, the module and source line that compute it, and
the fix; the same model counting with a one-hot sum goes through. Real CLI, real torch.export and
ExecuTorch (tests/core/histc_router_model.py holds the model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main
from writeback_core.core_aten import ops_outside_core_aten
from writeback_core.exporting import export_model

from tests.core import histc_router_model
from tests.decoders.test_llm_runner import _tokenizer

MODEL = Path(histc_router_model.__file__)
NAMED = "aten.histc.default in router (Router) at histc_router_model.py:30"


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--backend", "portable", "--steps", "3"],
        ["run", "--backend", "xnnpack", "--steps", "3"],
        ["export", "--backend", "xnnpack"],
        ["explain"],
        ["bench-generate", "--rounds", "1", "--prompt-tokens", "3", "--new-tokens", "4"],
    ],
    ids=["run-portable", "run-xnnpack", "export", "explain", "bench-generate"],
)
def test_an_op_outside_core_aten_exits_2_naming_op_module_line_and_fix_in_one_paragraph(
    tmp_path: Path, command: list[str]
) -> None:
    output = tmp_path / "model.pte"
    arguments = [command[0], f"{MODEL}:case", *command[1:]]
    if command[0] == "export":
        arguments += ["--output", str(output)]
    if command[0] == "bench-generate":
        _tokenizer(tmp_path)
        arguments += ["--tokenizer", str(tmp_path / "tokenizer.json")]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = result.output[result.output.index("Error: ") :]
    assert error.startswith("Error: model 'histc-router' computes an op outside Core ATen"), error
    assert NAMED in error
    assert "It would export once that code computes the same with Core ATen ops" in error
    assert len(error.strip().splitlines()) == 1, error  # one paragraph
    assert not output.exists()  # nothing written


def test_the_same_router_counting_with_a_one_hot_sum_runs_as_eager_no_false_refusal() -> None:
    result = CliRunner().invoke(main, ["run", f"{MODEL}:counted_case", "--backend", "portable", "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "all 3 steps match eager" in result.output


def test_ops_outside_core_aten_names_only_histc_not_the_ops_to_edge_decomposes() -> None:
    """``linear``, ``topk``, ``one_hot``, ``cat`` and the in-place ``add_`` all reach Core ATen."""
    args = (torch.tensor([[3]]), torch.tensor([0]))
    with torch.no_grad():  # export_model itself refuses the program: torch.export alone here
        programs = [torch.export.export(histc_router_model.RoutedDecoder(h), args) for h in (True, False)]
    refused = ops_outside_core_aten(programs[0])
    assert [(o.op, o.source) for o in refused] == [("aten.histc.default", NAMED.split(" in ", 1)[1])]
    assert ops_outside_core_aten(programs[1]) == []
    assert export_model(histc_router_model.RoutedDecoder(histc=False), args) is not None
