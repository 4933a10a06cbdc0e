"""writeback_bench.resident_memory reads this process's anonymous and file-backed resident memory and its
peak: 64 MiB written into a new buffer show as about 64 MiB more anonymous memory and peak, and
64 MiB of a file read through a mapping as file-backed memory."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
from writeback_bench.resident_memory import read_resident, reset_peak

MIB = 1 << 20
SIZE = 64 * MIB

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def test_a_written_64_mib_buffer_adds_64_mib_of_anonymous_memory_and_of_peak() -> None:
    assert reset_peak()
    before = read_resident()
    # A fresh private anonymous mapping: no page of it is resident before it is written. (A bytearray may
    # reuse heap pages the allocator already holds resident, and then adds less than its size.)
    with mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as buffer:
        buffer[:: mmap.PAGESIZE] = b"\1" * (SIZE // mmap.PAGESIZE)  # every page written
        after = read_resident()
    assert SIZE - 2 * MIB <= after.anon - before.anon <= SIZE + 8 * MIB, (before, after)
    assert abs(after.file - before.file) <= 4 * MIB, (before, after)
    assert after.peak >= before.total + SIZE - 2 * MIB, (before, after)


def test_64_mib_of_a_mapped_file_read_add_file_backed_memory_not_anonymous(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"\1" * SIZE)
    before = read_resident()
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        total = sum(mapped[i] for i in range(0, SIZE, mmap.PAGESIZE))  # every page read
        after = read_resident()
    assert total == SIZE // mmap.PAGESIZE
    assert SIZE - 2 * MIB <= after.file - before.file <= SIZE + 4 * MIB, (before, after)
    assert after.anon - before.anon <= 4 * MIB, (before, after)
