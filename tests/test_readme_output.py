"""README.md quotes what the current code prints: every block under an ``<!-- output: ... -->``
marker equals what its command prints now, line by line, once the figures that timing or the
machine decide are masked (docs/readme_output.py, which also rewrites the blocks).

One test per marker; markers that run a command of the slow tier (``SLOW`` in the script:
benchmarks, export and generate, fuzz; and scripts run in a fresh process) are marked slow.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_output", ROOT / "docs" / "readme_output.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


readme_output = _script()
README = (ROOT / "README.md").read_text()
MARKERS = readme_output.markers(README)


def _case(marker: Any) -> Any:
    slow = readme_output.is_slow(marker.text)
    return pytest.param(marker, id=marker.text, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("marker", [_case(m) for m in MARKERS])
def test_the_readme_block_is_what_its_command_prints(marker: Any) -> None:
    fresh = readme_output.produce(marker.text)
    diff = readme_output.differences(marker.quoted, fresh)
    assert not diff, "\n".join(
        [
            f"README.md's block under <!-- output: {marker.text} --> is not what the command prints now; "
            f"if the change is meant, rewrite it: uv run python docs/readme_output.py {shlex.quote(marker.text)}",
            *diff,
        ]
    )


def test_every_block_that_quotes_a_command_has_a_marker() -> None:
    """A fenced block starting with ``$ writeback`` or ``$ python`` is quoted output: it needs a marker."""
    lines = README.splitlines()
    unmarked = [
        index + 1
        for index, line in enumerate(lines)
        if line == "```"
        and index + 1 < len(lines)
        and re.match(r"\$ (writeback|python) ", lines[index + 1])
        and not (index > 0 and lines[index - 1].startswith("<!-- output: "))
    ]
    assert not unmarked, f"README.md lines {unmarked}: a block quotes a command's output without a marker"
    assert len(MARKERS) >= 10, [m.text for m in MARKERS]


def test_every_marker_names_setups_and_commands_the_script_knows() -> None:
    for marker in MARKERS:
        assert readme_output.parts(marker.text), marker.text


# The comparison itself, against blocks written by hand.

_RUN_TABLE = [
    "┏━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━┓",
    "┃ step ┃ latency ms ┃ max abs err (out) ┃",
    "┡━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━┩",
    "│    0 │      6.507 │          7.15e-07 │",
    "└──────┴────────────┴───────────────────┘",
]


def test_a_changed_word_or_line_differs() -> None:
    quoted = ["backend mlx, runtime pybind, lowered in 4.0 s, 59.4 KiB .pte at model.pte", "all 3 steps match"]
    assert readme_output.differences(quoted, quoted) == []
    assert readme_output.differences(quoted, [quoted[0].replace("mlx", "xnnpack"), quoted[1]])
    assert readme_output.differences(quoted, [quoted[0]])
    assert readme_output.differences(quoted, [*quoted, "one more line"])
    # a size the code decides is compared, not masked
    assert readme_output.differences(quoted, [quoted[0].replace("59.4 KiB", "60.1 KiB"), quoted[1]])


def test_timing_and_the_machine_are_masked() -> None:
    quoted = [
        "backend mlx, runtime pybind, lowered in 4.0 s, 59.4 KiB .pte at model.pte",
        "2 programs passed in 7.5 s (3.77 s/program); runtime targets on 2",
        "  stock / writeback, whole step: 3.66 (met, goal >= 3)",
        "this machine has 22.8 GiB of memory available, so at most 2919 MiB",
        'PyTorchObserver {"prefill_token_per_sec":3000,"model_load_start_ms":1796402422794}',
        "writeback+xnnpack                                          16000.0       2250.0      3.00     3.39  -",
        "│ eager                   │  2.09 ms │                 1.1x │",
        "│ stock+xnnpack+reinplace │  1.02 ms │                 2.0x │",
        "lowered in 1.1 s",
    ]
    fresh = [
        "backend mlx, runtime pybind, lowered in 12.8 s, 59.4 KiB .pte at model.pte",
        "2 programs passed in 31.0 s (15.5 s/program); runtime targets on 2",
        "  stock / writeback, whole step: 2.10 (MISSED, goal >= 3)",
        "this machine has 3.1 GiB of memory available, so at most 397 MiB",
        'PyTorchObserver {"prefill_token_per_sec":1500,"model_load_start_ms":1796299440353}',
        "writeback+xnnpack                                           1600.0        178.5     10.00    12.17  -",
        "│ eager                   │ 111.19 ms │                 0.7x │",
        # a time crossing a unit's boundary between runs
        "│ stock+xnnpack+reinplace │ 998.6 µs │                 2.1x │",
        "lowered in 980 ms",
    ]
    assert readme_output.differences(quoted, fresh) == []
    # the runner rounds to whole milliseconds: a prefill of 0 ms has an infinite rate, left out of its JSON
    quoted = [
        'PyTorchObserver {"prefill_token_per_sec":3000,"decode_token_per_sec":15000}',
        "prefill 3000.0 tokens/s (1 ms)",
    ]
    fresh = ['PyTorchObserver {"decode_token_per_sec":15000}', "prefill inf tokens/s (0 ms)"]
    assert readme_output.differences(quoted, fresh) == []


def test_a_measured_column_is_masked_and_the_others_compared() -> None:
    slower = [line.replace("6.507", "12.25") for line in _RUN_TABLE]
    assert readme_output.differences(_RUN_TABLE, slower) == []
    # A rounding error's last bits follow the CPU's kernels: masked; a step number is compared.
    rounded = [line.replace("7.15e-07", "9.54e-07") for line in _RUN_TABLE]
    assert readme_output.differences(_RUN_TABLE, rounded) == []
    wrong = [line.replace("│    0 │", "│    1 │") for line in _RUN_TABLE]
    assert readme_output.differences(_RUN_TABLE, wrong)
    renamed = [line.replace("max abs err (out)", "max rel err (out)") for line in _RUN_TABLE]
    assert readme_output.differences(_RUN_TABLE, renamed)


def test_a_block_is_rewritten_under_its_marker_alone() -> None:
    readme = "intro\n<!-- output: writeback plugins -->\n```\nold\nlines\n```\nafter\n```\n$ kept\n```\n"
    (marker,) = readme_output.markers(readme)
    assert marker.quoted == ("old", "lines")
    rewritten = readme_output.rewrite(readme, marker, ["$ writeback plugins", "new"])
    assert rewritten == readme.replace("old\nlines", "$ writeback plugins\nnew")


def test_a_marker_without_its_block_is_refused() -> None:
    with pytest.raises(ValueError, match="not followed by a ``` fence"):
        readme_output.markers("<!-- output: writeback plugins -->\ntext\n")
    with pytest.raises(ValueError, match="neither a setup"):
        readme_output.parts("ls -l")
