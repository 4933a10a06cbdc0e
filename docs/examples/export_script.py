"""An ExecuTorch export script with writeback's two lines (marked), run on the built-in
``decoder``; then the same script with ExecuTorch's bare partitioner, which warns.

Run: ``uv run python docs/examples/export_script.py [BACKEND]`` (default xnnpack).
"""

from __future__ import annotations

import sys
import warnings

from executorch.exir import to_edge_transform_and_lower
from writeback.model_build import export_case
from writeback.zoo import builtin_models
from writeback_core import CopyLeftWarning, load_registry, to_edge_arguments
from writeback_core.lowering import lower
from writeback_passes import to_executorch

backend = sys.argv[1] if len(sys.argv) > 1 else "xnnpack"
case = builtin_models()["decoder"]
ep = export_case(case)  # torch.export.export(model, example_inputs), as the case exports it

# The user's script; writeback's two lines are marked.
edge = to_edge_transform_and_lower(ep, **to_edge_arguments(backend))  # writeback: 1 of 2
program = to_executorch(edge)  # writeback: 2 of 2
pte = bytes(program.buffer)

registry = load_registry()
same = pte == lower(ep, registry, registry.backends()[backend]).pte
print(f"{backend}: {len(pte)} bytes; byte for byte lower()'s program: {same}")

# Half-way: ExecuTorch's own partitioner, writeback's to_executorch. It says what stays copied.
if backend == "xnnpack":
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CopyLeftWarning)
        to_executorch(to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]))
    for warning in caught:
        if issubclass(warning.category, CopyLeftWarning):
            print(f"{warning.category.__name__}: {warning.message}")
