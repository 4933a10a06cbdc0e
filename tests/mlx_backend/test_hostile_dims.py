"""Hostile dims, indices and sizes in an MLX blob: refused at ``init``, naming the step, op, dim and rank.

MLX does not check scatter bounds: on a delegate that wrapped a dim by adding the rank
once, ``index_copy(cache, -3, pos, row)`` on a rank-2 cache passed ``init`` and then wrote
past the cache (the process aborted with "corrupted size vs. prev_size"). Every blob here
is run in a child process, so a regression fails the test instead of killing the run:
the child initializes the blob and, should ``init`` accept it, runs one call.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from writeback_core.blob import BlobError
from writeback_mlx_backend import MLXDelegate

from tests.mlx_backend.embedding_cache_blob import embedding_cache_program, run_embedding_cache

_ROOT = Path(__file__).resolve().parents[2]


def _node(name: str, op: str, args: list[Any], kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "op": op, "args": args, "kwargs": kwargs or {}, "dtype": "float32"}


R = {"$v": "r"}  # the blob's [1, 3] value; the cache is [4, 3]

# case -> (the node inserted before the cache write, or None to change the write itself,
# the write's dim; what the error must say). Each is a dim, index or size eager refuses.
CASES: dict[str, tuple[dict[str, Any] | None, int, str]] = {
    "index_copy_dim_minus_3_on_rank_2": (None, -3, r"index_copy dim: .*\[-2, 1\] for a tensor of rank 2, but got -3"),
    "index_copy_dim_2_on_rank_2": (None, 2, r"index_copy dim: .*rank 2, but got 2"),
    "index_copy_dim_as_tensor": (None, 0, r""),  # replaced below: dim given as a reference
    "index_copy_source_shape": (
        _node("x", "aten.index_copy.default", [{"$v": "cache"}, 0, {"$v": "pos"}, {"$v": "emb"}]),
        0,
        r"index_copy: source of shape \[5, 3\], expected \[1, 3\]",
    ),
    "index_select_dim": (
        _node("x", "aten.index_select.default", [R, 2, {"$v": "pos"}]),
        0,
        r"index_select dim: .*rank 2, but got 2",
    ),
    "slice_dim": (_node("x", "aten.slice_copy.Tensor", [R, -3, 0, 1, 1]), 0, r"slice dim: .*rank 2, but got -3"),
    "split_part_dim": (_node("x", "aten.slice_copy.Tensor", [R, 2, 0, 1, 1]), 0, r"slice dim: .*rank 2, but got 2"),
    "select_dim": (_node("x", "aten.select_copy.int", [R, -3, 0]), 0, r"select dim: .*rank 2, but got -3"),
    "select_index": (_node("x", "aten.select_copy.int", [R, 0, 1]), 0, r"index 1 is out of bounds .* size 1"),
    "cat_dim": (_node("x", "aten.cat.default", [[R, R], 2]), 0, r"cat dim: .*rank 2, but got 2"),
    "cat_part_shape": (
        _node("x", "aten.cat.default", [[R, {"$v": "emb"}], 1]),
        0,
        r"cat: part of shape \[5, 3\] does not match \[1, 3\]",
    ),
    "softmax_dim": (_node("x", "aten._softmax.default", [R, 2, False]), 0, r"softmax dim: .*rank 2, but got 2"),
    "sum_dim": (_node("x", "aten.sum.dim_IntList", [R, [-3]]), 0, r"sum dim: .*rank 2, but got -3"),
    "sum_dim_twice": (_node("x", "aten.sum.dim_IntList", [R, [0, -2]]), 0, r"sum dim: \[0, -2\] names an axis twice"),
    "mean_dim": (_node("x", "aten.mean.dim", [R, [5]]), 0, r"mean dim: .*rank 2, but got 5"),
    "amax_dim": (_node("x", "aten.amax.default", [R, [2]]), 0, r"amax dim: .*rank 2, but got 2"),
    "any_dim": (_node("x", "aten.any.dim", [R, -3]), 0, r"any dim: .*rank 2, but got -3"),
    "transpose_dim": (_node("x", "aten.transpose_copy.int", [R, 0, 2]), 0, r"transpose dim1: .*rank 2, but got 2"),
    "permute_dim": (_node("x", "aten.permute_copy.default", [R, [0, 2]]), 0, r"permute dim: .*rank 2, but got 2"),
    "permute_short": (_node("x", "aten.permute_copy.default", [R, [0]]), 0, r"permute: dims \[0\] .* rank 2"),
    "permute_twice": (_node("x", "aten.permute_copy.default", [R, [0, 0]]), 0, r"permute: dims \[0, 0\]"),
    "expand_fewer_dims": (_node("x", "aten.expand_copy.default", [R, [3]]), 0, r"expand: size \[3\] .* rank 2"),
    "expand_new_minus_one": (
        _node("x", "aten.expand_copy.default", [R, [-1, 1, 3]]),
        0,
        r"expand: size -1 at new leading dimension 0",
    ),
    "expand_other_size": (_node("x", "aten.expand_copy.default", [R, [2, 4]]), 0, r"expand: size 4 at dimension 1"),
    "unsqueeze_dim": (_node("x", "aten.unsqueeze_copy.default", [R, 3]), 0, r"unsqueeze dim: .*rank 3, but got 3"),
    "squeeze_dim": (_node("x", "aten.squeeze_copy.dims", [R, [2]]), 0, r"squeeze dim: .*rank 2, but got 2"),
    "view_size": (_node("x", "aten.view_copy.default", [R, [2, 2]]), 0, r"view: size \[2, 2\] does not hold .* 3"),
    "full_size": (_node("x", "aten.full.default", [[2, -1], 0.0]), 0, r"full: size -1 at dimension 1"),
    "full_too_large": (
        _node("x", "aten.full.default", [[1 << 20, 1 << 20], 0.0]),
        0,
        r"full: size \[1048576, 1048576\] holds more than 2147483647 elements",
    ),
    "arange_zero_step": (_node("x", "aten.arange.start_step", [0, 4, 0]), 0, r"arange: step must be nonzero"),
    "arange_wrong_side": (_node("x", "aten.arange.start_step", [4, 0, 1]), 0, r"arange: end 0 is on the wrong side"),
    "slice_scatter_source": (
        _node("x", "aten.slice_scatter.default", [{"$v": "cache"}, R, 0, 0, 2, 1]),
        0,
        r"slice_scatter: source of shape \[1, 3\], expected \[2, 3\]",
    ),
    "mm_shapes": (
        _node("x", "aten.mm.default", [R, R]),
        0,
        r"aten.mm.default: its arguments' shapes do not fit the op \(\[matmul\]",
    ),
    "add_shapes_of_a_renamed_reference": (
        _node("x", "aten.add.Tensor", [{"$v": "emb"}, {"$v": "cache"}]),
        0,
        r"aten.add.Tensor: its arguments' shapes do not fit the op \(\[broadcast_shapes\]",
    ),
    "index_put_indices": (
        _node("x", "aten.index_put.default", [R, [{"$v": "pos"}, {"$v": "pos"}, {"$v": "pos"}], R]),
        0,
        r"index_put: 3 indices for a tensor of rank 2",
    ),
}


def _blob(case: str) -> bytes:
    node, dim, _ = CASES[case]
    program = embedding_cache_program()
    write = program.nodes[2]
    write["args"][1] = {"$v": "tok"} if case == "index_copy_dim_as_tensor" else dim
    if node is not None:
        program.nodes.insert(2, node)
    return program.to_bytes()


def run_cases(cases: list[str]) -> None:
    """The child: one JSON line per case, ``{"case", "refused", "error"}``; a blob ``init``
    accepts is then run once (where a regression would crash the child)."""
    for case in cases:
        delegate = MLXDelegate()
        try:
            handle = delegate.init(_blob(case), {})
        except BlobError as error:
            print(json.dumps({"case": case, "refused": True, "error": str(error)}), flush=True)
            continue
        try:
            run_embedding_cache(delegate, handle, 1, 0, [0.0, 0.0, 0.0])
            error_text = "init accepted it and a call ran"
        except Exception as error:  # a clean error at the call: still a failure of init
            error_text = f"init accepted it; the call raised {type(error).__name__}: {error}"
        print(json.dumps({"case": case, "refused": False, "error": error_text}), flush=True)


@pytest.fixture(scope="module")
def child_results() -> dict[str, Any]:
    code = f"from tests.mlx_backend.test_hostile_dims import run_cases; run_cases({sorted(CASES)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    results: dict[str, Any] = {"returncode": done.returncode, "stderr": done.stderr[-2000:]}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["case"]] = record
    return results


@pytest.mark.parametrize("case", sorted(CASES))
def test_out_of_range_literal_refused_in_init_naming_step_op_dim_rank_no_crash(
    case: str, child_results: dict[str, Any]
) -> None:
    record = child_results.get(case)
    assert record is not None, (
        f"the child process died before reporting {case} (exit {child_results['returncode']}): "
        f"{child_results['stderr']}"
    )
    assert record["refused"], record["error"]
    error = record["error"]
    step = "c" if CASES[case][0] is None else "x"
    assert f"mlx delegate blob: field nodes[2] = {step!r}: aten." in error, error
    assert "nothing was run" in error and "lower the model again" in error, error
    if case == "index_copy_dim_as_tensor":
        assert "dim" in error, error
    else:
        assert re.search(CASES[case][2], error), (CASES[case][2], error)
    assert child_results["returncode"] == 0, child_results["stderr"]


def test_in_range_negative_dims_still_run_as_eager() -> None:
    """The checks take what eager takes: ``dim=-2`` is the cache's axis 0."""
    program = embedding_cache_program()
    program.nodes[2]["args"][1] = -2
    program.nodes[3]["args"][1] = [-2]
    delegate = MLXDelegate()
    handle = delegate.init(program.to_bytes(), {})
    cache = torch.zeros(4, 3)
    emb = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    for tok, pos in ((2, 1), (4, 3)):
        _, s = run_embedding_cache(delegate, handle, tok, pos, [1.0, 1.0, 1.0])
        cache.index_copy_(-2, torch.tensor([pos]), emb[tok : tok + 1] + 1)
        assert torch.equal(s, cache.sum(-2))
