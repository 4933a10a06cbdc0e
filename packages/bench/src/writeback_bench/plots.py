"""The plots of ``writeback bench --plot``: the cache-size bench's (:func:`plot`) and the model
bench's (:func:`plot_model`), drawn with matplotlib on the Agg backend, and the check that
refuses a ``--plot`` path matplotlib cannot write before anything is timed (:func:`check_plot`).
matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from writeback import replacing

from writeback_bench.cache_sizes import PIPELINES, REINPLACE, SLICE_COPY, WRITEBACK, BenchResult
from writeback_bench.contenders import EAGER, STOCK, WARMUP, XNNPACK
from writeback_bench.model_steps import ModelBenchResult

__all__ = ["check_plot", "plot", "plot_model"]


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or a usage error saying how to install it."""
    try:
        import matplotlib
    except ImportError as error:
        raise click.UsageError(
            "--plot needs matplotlib: pip install matplotlib==3.11.2 (the workspace's dev group has it)"
        ) from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_format(path: Path) -> str:
    """The image format ``--plot`` writes, from the file's suffix (``png`` without one)."""
    return path.suffix.lstrip(".").lower() or "png"


def check_plot(path: Path) -> None:
    """Refuse (``click.UsageError``) a ``--plot`` path matplotlib cannot write, before any timing."""
    plt = _pyplot()
    fig = plt.figure()
    try:
        formats = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    if _plot_format(path) not in formats:
        raise click.BadParameter(
            f"cannot write {path}: matplotlib writes {', '.join(sorted(formats))}; end the name with one of them",
            param_hint="'--plot'",
        )


def plot(result: BenchResult, path: Path) -> None:
    """Step time and state-update time against cache size, one line per pipeline, log scales.

    The image (its format from ``path``'s suffix) replaces ``path`` whole or not at all."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = [s.mib for s in result.sizes]
    styles = {STOCK: "o-", REINPLACE: "s-", XNNPACK: "D-", WRITEBACK: "^-", EAGER: "k--", SLICE_COPY: "k:"}

    def line(axis: Any, name: str, values: list[float | None]) -> None:
        points = [(x, v * 1e3) for x, v in zip(sizes, values, strict=True) if v is not None and v > 0]
        if points:
            axis.plot(*zip(*points, strict=True), styles[name], label=name)

    for name in (*PIPELINES, EAGER):
        line(left, name, [s.median(name, "step") for s in result.sizes])
    for name in (*PIPELINES, SLICE_COPY):
        line(right, name, [s.update(name) for s in result.sizes])
    for axis, title in ((left, "decode step"), (right, "state update (update - idle call)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("K+V cache (MiB)")
        axis.set_ylabel("ms (median)")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` (format from its suffix), replacing it whole or not at all."""
    fig.tight_layout()
    try:
        with replacing(path) as temporary:
            fig.savefig(temporary, dpi=120, format=_plot_format(path))
    finally:
        plt.close(fig)


def plot_model(result: ModelBenchResult, path: Path) -> None:
    """A bar per contender (median step, ms), labelled with the copies it leaves per call.

    The image (its format from ``path``'s suffix) replaces ``path`` whole or not at all."""
    plt = _pyplot()
    measured = [(r.name, r.median(), r.copies) for r in result.rows]
    fig, axis = plt.subplots(figsize=(9, 0.5 * len(measured) + 1.5))
    names = [name for name, _, _ in measured]
    values = [(m or 0.0) * 1e3 for _, m, _ in measured]
    bars = axis.barh(names, values, color=["tab:blue" if m is not None else "lightgrey" for _, m, _ in measured])
    for bar, (_, median, copies) in zip(bars, measured, strict=True):
        label = "failed" if median is None else f"{median * 1e3:.2f} ms, {copies if copies is not None else '-'} copies"
        axis.annotate(
            label,
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    axis.invert_yaxis()
    axis.set_xlabel("ms (median)")
    axis.set_title(f"{result.case.name}: one call from step {result.start + WARMUP}")
    axis.grid(True, axis="x", alpha=0.3)
    _save(plt, fig, path)
