"""``check_literals`` walks past a step it cannot trace instead of giving up on the rest.

Hazard from the review: the walk ended at the first step it could not trace (one reading a
scalar input), so a hostile dim in any later step, even one that never reads that value,
passed ``init`` unchecked, and MLX, which does not check scatter bounds, would write past
the cache. Only the steps reading the untraced value are left to their run-time checks.
"""

from __future__ import annotations

import pytest
from writeback_core.blob import BlobError
from writeback_mlx_backend import MLXDelegate
from writeback_mlx_backend.delegate_program import DelegateProgram

from tests.mlx_backend.embedding_cache_blob import embedding_cache_program


def _with_scalar_step(write_dim: int) -> DelegateProgram:
    """The embedding-cache program with a scalar input ``k`` and a first step ``m = row * k``
    (no traced value: ``k`` has no static value) that the cache write does not read."""
    program = embedding_cache_program()
    program.inputs.append("k")
    program.input_meta.append({"scalar": True})
    program.nodes.insert(
        0,
        {"name": "m", "op": "aten.mul.Tensor", "args": [{"$v": "row"}, {"$v": "k"}], "kwargs": {}, "dtype": "float32"},
    )
    write = next(n for n in program.nodes if n["name"] == "c")
    write["args"][1] = write_dim
    return program


def test_hostile_dim_after_an_untraceable_step_is_refused_in_init_nothing_run() -> None:
    with pytest.raises(BlobError) as raised:
        MLXDelegate().init(_with_scalar_step(-3).to_bytes(), {})
    message = str(raised.value)
    assert "field nodes[3] = 'c': aten.index_copy.default" in message, message
    assert "rank 2, but got -3" in message and "nothing was run" in message, message


def test_program_with_an_untraceable_step_still_initializes() -> None:
    delegate = MLXDelegate()
    handle = delegate.init(_with_scalar_step(0).to_bytes(), {})
    assert delegate.path(handle) == "interpreted: it has scalar inputs"


def test_a_step_that_fails_to_trace_warns_naming_the_fusions_it_loses() -> None:
    """The fusions' shape trace used to end silently at the first step that raised, dropping
    every pattern after it; now it leaves out only that step and its readers, and says so."""
    import mlx.core as mx
    from writeback_core.blob import Ref
    from writeback_mlx_backend._steps import Step
    from writeback_mlx_backend.mlx_delegate import FusionsSkippedWarning, _lazy_info
    from writeback_mlx_backend.op_table import OPS

    program = embedding_cache_program()
    view = "aten.view_copy.default"
    steps = [
        Step("bad", view, OPS[view], [Ref("row"), [7, 7]], {}, None),  # 3 values cannot be 7 x 7
        Step("after", view, OPS[view], [Ref("bad"), [49]], {}, None),  # reads it: left out, silently
        Step("apart", view, OPS[view], [Ref("row"), [3]], {}, None),  # does not: still traced
    ]
    with pytest.warns(FusionsSkippedWarning, match=r"step 0 'bad' \(aten.view_copy.default\) could not be traced"):
        info = _lazy_info(program, steps, {"emb": mx.zeros((5, 3))}, {"cache": mx.zeros((4, 3))})
    assert "bad" not in info and "after" not in info
    assert info["apart"][0] == (3,) and info["row"][0] == (1, 3)
