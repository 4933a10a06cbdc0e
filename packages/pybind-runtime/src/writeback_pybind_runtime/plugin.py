"""Entry-point plugin of writeback-pybind-runtime (thin: imports core and torch only).

The compiled runtime is imported inside the runtime spec's ``load_program``,
so loading the plugin never builds or loads the extension.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from writeback_core import hookimpl
from writeback_core.types import RuntimeDelegate, RuntimeSpec

writeback_name = "pybind-runtime"


def _load_program(data: bytes | os.PathLike[str], delegates: Mapping[str, RuntimeDelegate]) -> Any:
    from writeback_pybind_runtime import Runtime

    runtime = Runtime.get()
    # The pipeline's registry chose these delegates; registered once, not per load.
    runtime.use_delegates(delegates)
    return runtime.load_program(data)


@hookimpl
def writeback_runtimes() -> Sequence[RuntimeSpec]:
    return [
        RuntimeSpec(
            name="pybind",
            load_program=_load_program,
            description="the ExecuTorch runtime library; mutated caller tensors updated in place",
            preferred=True,
        )
    ]
