"""``FilePages``: the pages of a clean file map behind a tensor go back to the system and read back
unchanged; a written private map, or memory that is no file's, is never touched."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from writeback_core.memory import FilePages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

PAGES = 64


def _mapped(path: Path) -> tuple[np.memmap, torch.Tensor]:
    values = np.arange(PAGES * 1024, dtype=np.float32)  # 4 KiB of float32 a page
    values.tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="c")  # a private map, as a model's weights are
    return mapped, torch.from_numpy(mapped)


def _resident_kib(tensor: torch.Tensor) -> int:
    """``Rss`` of the map holding ``tensor`` (kB), from ``/proc/self/smaps``."""
    pointer = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= pointer < end
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("no map holds the tensor")


def test_a_clean_file_maps_pages_are_released_and_read_back_unchanged(tmp_path: Path) -> None:
    mapped, tensor = _mapped(tmp_path / "weights.bin")
    assert float(tensor.sum()) > 0  # read every page
    assert _resident_kib(tensor) >= PAGES * 4
    released = FilePages().release(tensor)
    assert released == PAGES * 4096
    assert _resident_kib(tensor) == 0
    assert torch.equal(tensor, torch.arange(PAGES * 1024, dtype=torch.float32))  # read back from the file
    del mapped


def test_a_written_private_map_is_left_alone_and_keeps_its_written_value(tmp_path: Path) -> None:
    mapped, tensor = _mapped(tmp_path / "weights.bin")
    tensor[5] = -1.0  # the process's own copy of that page now
    assert FilePages().release(tensor) == 0
    assert float(tensor[5]) == -1.0 and float(tensor[6]) == 6.0
    del mapped


def test_memory_that_is_no_files_is_left_alone_unchanged() -> None:
    tensor = torch.arange(PAGES * 1024, dtype=torch.float32)
    pages = FilePages()
    assert pages.release(tensor) == 0
    assert pages.release(torch.empty(0)) == 0
    assert torch.equal(tensor, torch.arange(PAGES * 1024, dtype=torch.float32))


def test_a_map_made_after_the_snapshot_is_not_released(tmp_path: Path) -> None:
    pages = FilePages()  # taken before the file is mapped: the map is not known clean
    mapped, tensor = _mapped(tmp_path / "weights.bin")
    assert float(tensor.sum()) > 0
    assert pages.release(tensor) == 0
    assert _resident_kib(tensor) >= PAGES * 4
    del mapped
