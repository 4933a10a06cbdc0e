"""The pass tests lower through exir's own to_edge, with no writeback-wrapped partitioner, and
look at where the write-back copies sit: every such program keeps its copies by design, and
writeback_passes.to_executorch says so with a CopyLeftWarning (tests/e2e/test_export_idiom.py
makes it fire). Here it is expected, so it is not an error."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/passes/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.filterwarnings("ignore::writeback_core.copies.CopyLeftWarning"))
