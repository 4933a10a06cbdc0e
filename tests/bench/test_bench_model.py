"""`writeback bench --model NAME`: every contender gets its row, with the whole-state copies its
program leaves per call, and one that fails keeps its row with the reason, the others go on.

Copies worked out by hand for the tiny decoder with 2 layers and registered K/V caches
[1, 2, 16, 16] fp32 (2 KiB each): stock ExecuTorch writes each of the 4 caches back whole
every call (4 copies, 8.0 KiB); exir's reinplace pass makes the ``index_copy`` writes in
place (0); writeback + MLX keeps the caches in the delegate (0).
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from writeback.cli import main
from writeback.zoo import DecoderConfig, decoder_case
from writeback_bench.model_steps import model_contenders, model_table, run_model_bench
from writeback_core.registry import load_registry
from writeback_core.types import ModelCase

MODEL_FILE = """
import dataclasses

from writeback.zoo import DecoderConfig, decoder_case


def _no_such_export():
    raise RuntimeError("no export")


def make():
    case = decoder_case(DecoderConfig(layers=2))
    return dataclasses.replace(case, name="tiny2", contenders={"broken": _no_such_export})
"""


def _broken() -> object:
    raise RuntimeError("no export")


def _tiny2() -> ModelCase:
    return dataclasses.replace(decoder_case(DecoderConfig(layers=2)), name="tiny2", contenders={"broken": _broken})


def _rows(text: str) -> dict[str, list[str]]:
    """Table rows by contender name (the first cell): the row's cells, stripped."""
    found = {}
    for line in text.splitlines():
        if line.startswith("│ "):
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            if cells[0]:  # not a cell's wrapped continuation line
                found[cells[0]] = cells
    return found


def test_contender_that_raises_keeps_its_failed_row_and_the_others_still_run() -> None:
    result = run_model_bench(load_registry(), _tiny2(), steps=2, contenders=["eager", "broken"])
    eager, broken = result.rows
    assert eager.error is None and len(eager.times) == 2 and eager.copies == 0
    assert broken.error is not None and "RuntimeError: no export" in broken.error
    assert broken.times == [] and broken.copies is None
    console = Console(record=True, width=200)
    console.print(model_table(result))
    rows = _rows(console.export_text())
    assert rows["broken"][1] == "failed to lower or load: RuntimeError: no export"
    assert rows["eager"][3] == "0" and rows["eager"][1].endswith(("ms", "µs"))


def test_offered_contenders_are_upstream_then_every_backend_then_the_models_own() -> None:
    registry = load_registry()
    offered = model_contenders(registry, _tiny2())
    backends = [f"writeback+{name}" for name in sorted(registry.backends())]
    assert offered == ["eager", "stock", "stock+xnnpack", "stock+xnnpack+reinplace", *backends, "broken"]
    assert "writeback+mlx" in offered


def test_unknown_contender_is_refused_before_anything_is_lowered_and_lists_the_offered() -> None:
    with pytest.raises(ValueError, match=r"no contender named 'nosuch'; offered: eager, stock, "):
        run_model_bench(load_registry(), _tiny2(), steps=1, contenders=["eager", "nosuch"])


@pytest.mark.parametrize("args", [["--steps", "3"], ["--start", "4"], ["--contenders", "stock"]])
def test_model_options_without_model_are_a_usage_error_naming_the_option(args: list[str]) -> None:
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert f"{args[0]} go with --model NAME" in result.output


@pytest.mark.slow
def test_bench_model_file_prints_each_contender_with_its_copies_and_writes_the_plot(tmp_path: Path) -> None:
    model = tmp_path / "tiny2.py"
    model.write_text(textwrap.dedent(MODEL_FILE))
    plot = tmp_path / "model.png"
    contenders = "eager,stock,stock+xnnpack,stock+xnnpack+reinplace,writeback+mlx,broken"
    result = CliRunner().invoke(
        main,
        ["bench", "--model", f"{model}:make", "--steps", "2", "--contenders", contenders, "--plot", str(plot)],
    )
    assert result.exit_code == 0, result.output
    rows = _rows(result.output)
    assert list(rows) == contenders.split(","), rows
    # contender | step | stock+xnnpack / this | whole-state copies/call | copies vs stock+xnnpack
    assert rows["stock"][3:] == ["4 (8.0 KiB)", "4 vs 4"]
    assert rows["stock+xnnpack"][2:] == ["1.0x", "4 (8.0 KiB)", "4 vs 4"]
    assert rows["stock+xnnpack+reinplace"][3:] == ["0", "0 vs 4"]
    assert rows["writeback+mlx"][3:] == ["0", "0 vs 4"]
    assert rows["eager"][3:] == ["0", "0 vs 4"]
    for name in ("eager", "stock", "stock+xnnpack", "stock+xnnpack+reinplace", "writeback+mlx"):
        assert rows[name][1].endswith(("ms", "µs")), rows[name]  # a median: ran and matched eager
    assert rows["broken"][1:] == ["failed to lower or load: RuntimeError: no export", "-", "-", "-"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class SeqMajorCache(torch.nn.Module):
    """``cache[:, pos] = k`` on a [batch, seq, heads, dim] cache, ExecuTorch Llama's index_put form."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 8, 2, 4))

    def forward(self, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        self.cache[:, pos] = k
        return self.cache.sum(1)


def test_kernel_failing_at_run_time_names_its_logged_reason_in_the_cell_and_the_others_still_run() -> None:
    """exir's reinplace pass turns this write into stock's in-place ``index_put_``, whose kernel
    refuses it (it wants the values' size at dim 1, 4 here, to equal the index length, 1). The
    Python error says only ``0x12``; the cell also carries the kernel's logged reason."""
    case = ModelCase(
        "seq-major",
        "index_put at dim 1",
        SeqMajorCache,
        lambda step: (torch.tensor([step]), torch.full((1, 1, 2, 4), float(step + 1))),
    )
    result = run_model_bench(load_registry(), case, 2, 0, ["eager", "stock+xnnpack", "stock+xnnpack+reinplace"])
    rows = {row.name: row for row in result.rows}
    failed = rows["stock+xnnpack+reinplace"].error
    assert failed is not None and failed.startswith("failed at run time: RuntimeError:")
    assert "0x12 (Special case in-place index_put requires values to match index length" in failed
    assert rows["stock+xnnpack"].error is None and len(rows["stock+xnnpack"].times) == 2
    assert rows["stock+xnnpack"].copies == 1  # the 256 B cache copied back whole every call


def test_bench_model_times_with_one_model_of_weights_alive_the_export_and_lowerings_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real-size model's weights must not be held once per contender: while the rounds are
    timed, the only model alive is the eager row's (the shared export and each lowering are
    dropped, the programs run from their files)."""
    import gc
    import weakref

    from writeback_bench import model_steps as bench_model

    base = decoder_case(DecoderConfig(layers=2))
    built: list[list[weakref.ref[torch.Tensor]]] = []

    def build() -> torch.nn.Module:
        module = base.build()
        built.append([weakref.ref(p) for p in module.parameters()])
        return module

    alive: list[list[int]] = []
    timed = bench_model._time_model_rounds

    def counting(*args: object, **kwargs: object) -> None:
        gc.collect()
        alive.append([sum(ref() is not None for ref in refs) for refs in built])
        timed(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(bench_model, "_time_model_rounds", counting)
    case = dataclasses.replace(base, build=build)
    # The rows on the portable kernels: their release is the same code as the XNNPACK rows', at
    # a third of the lowering time (XNNPACK delegates' own release: tests/e2e/test_run_command.py).
    contenders = ["eager", "stock", "writeback+portable"]
    result = run_model_bench(load_registry(), case, steps=1, contenders=contenders)
    assert [(row.name, row.error) for row in result.rows] == [(name, None) for name in contenders]
    per_model = len(built[0])
    # Built: the eager reference, the shared export, writeback's lowering, the eager row.
    assert len(built) == 4 and per_model == len(list(base.build().parameters()))
    assert alive == [[0, 0, 0, per_model]], f"parameters alive per built model while timing: {alive}"
