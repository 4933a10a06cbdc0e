"""What the blob fuzzer found, each kept as a test named after its hazard.

Each one is a field value that once let an internal exception escape a delegate's
``init``; the contract is :class:`~writeback_core.blob.BlobError` naming the delegate
and the field, and nothing run.
"""

from __future__ import annotations

import json

import pytest
import torch
from writeback_core.blob import BlobError, Kind, check_call, load_json
from writeback_example_backend.backend import ExampleRuntimeDelegate

_PLAN = {"dim": 0, "dest": 0, "index": 1, "source": 2, "inputs": 3}


@pytest.mark.parametrize("digits", [4301, 5000, 100_000])
def test_integer_past_pythons_digit_limit_is_blob_error_not_escaping_value_error(digits: int) -> None:
    text = b'{"n": ' + b"7" * digits + b"}"
    with pytest.raises(BlobError, match=r"kv-alias delegate blob: field blob = .*not UTF-8 JSON"):
        load_json(text, "kv-alias")
    # The same number of digits below the limit is an ordinary integer.
    assert load_json(b'{"n": ' + b"7" * 4300 + b"}", "x")["n"] == int("7" * 4300)


def test_huge_integer_in_a_delegate_blob_refused_in_init_no_crash() -> None:
    blob = json.dumps({**_PLAN, "dim": 0}).replace('"dim": 0', '"dim": ' + "9" * 5000).encode()
    with pytest.raises(BlobError, match="example delegate blob: field blob"):
        ExampleRuntimeDelegate().init(blob, {})


@pytest.mark.parametrize("dim", [2, 3, 2**62])
def test_example_dim_past_the_destinations_rank_refused_by_name_no_partial_write(dim: int) -> None:
    """``dim`` is only known to be in range at execute, against the destination's rank:
    eager's ``index_copy`` refuses it with ``IndexError``; so does the delegate, naming
    the dim and the rank, before it writes anything."""
    delegate = ExampleRuntimeDelegate()
    handle = delegate.init(json.dumps({**_PLAN, "dim": dim}).encode(), {})
    dest, out = torch.zeros(3, 2), torch.full((3, 2), -1.0)
    with pytest.raises(IndexError):
        torch.zeros(3, 2).index_copy(dim, torch.tensor([0]), torch.ones(1, 2))
    with pytest.raises(IndexError, match=rf"example delegate: dim {dim} indexes the destination.*rank 2"):
        delegate.execute(handle, [dest, torch.tensor([2]), torch.ones(1, 2), out])
    assert (out == -1).all() and not dest.any()


def test_example_index_of_floats_refused_by_name_no_partial_write() -> None:
    """A plan naming the float source as the index: eager's ``index_copy`` wants an
    integer index; the delegate refuses by name rather than compare floats."""
    delegate = ExampleRuntimeDelegate()
    handle = delegate.init(json.dumps({**_PLAN, "index": 2, "source": 1}).encode(), {})
    dest, out = torch.zeros(3, 2), torch.full((3, 2), -1.0)
    with pytest.raises(IndexError):
        torch.zeros(3, 2).index_copy(0, torch.ones(1, 2), torch.tensor([2]))
    with pytest.raises(IndexError, match=r"example delegate: the index .*int64"):
        delegate.execute(handle, [dest, torch.tensor([2]), torch.ones(1, 2), out])
    assert (out == -1).all() and not dest.any()


def _kind_of(value: object) -> Kind:
    return "ref" if isinstance(value, dict) and "$ref" in value else None


@pytest.mark.parametrize(
    ("op", "args", "in_range"),
    [
        ("aten.gt.Scalar", [{"$ref": "x"}, 10**30], [{"$ref": "x"}, 2**63 - 1]),
        ("aten.sum.dim_IntList", [{"$ref": "x"}, [0, 2**63]], [{"$ref": "x"}, [0, 2**63 - 1]]),
        ("aten.slice.Tensor", [{"$ref": "x"}, 0, 0, -(2**63) - 1], [{"$ref": "x"}, 0, 0, -(2**63)]),
    ],
)
def test_int_literal_past_64_bits_is_blob_error_not_escaping_overflow_error(
    op: str, args: list[object], in_range: list[object]
) -> None:
    """Kernels take 64-bit ints: torch's binding raises ``OverflowError`` past them (the
    kv-alias engine let it escape on ``steps[5].args[1] = 10**30`` of ``aten.gt.Scalar``)."""
    with pytest.raises(OverflowError):
        torch.ops.aten.gt.Scalar(torch.ones(2), 10**30)
    with pytest.raises(
        BlobError, match=r"kv-alias delegate blob: field steps\[5\]\.args\[\d\] = .*expected (a 64-bit int|number)"
    ):
        check_call(op, args, {}, "kv-alias", "steps[5]", _kind_of)
    check_call(op, in_range, {}, "kv-alias", "steps[5]", _kind_of)


def test_kv_alias_dim_order_exir_cannot_map_is_blob_error_not_escaping_assertion() -> None:
    """exir's ``_to_dim_order_copy`` asserts (``AssertionError``) on a dim order that is
    neither contiguous nor channels-last; the engine's blob reader refuses it first."""
    from writeback_trt_copyback._blob import compile_arg

    with pytest.raises(BlobError, match=r"kwargs\.\$dict\.dim_order = \[0, 0, 2, 3\]: a dim order must be"):
        compile_arg({"$dict": {"dim_order": [0, 0, 2, 3]}}, set(), "steps[9].kwargs")
    assert compile_arg({"$dict": {"dim_order": [0, 2, 3, 1]}}, set(), "k") == {"dim_order": [0, 2, 3, 1]}
    assert compile_arg({"$dict": {"dim_order": None}}, set(), "k") == {"dim_order": None}


@pytest.fixture(scope="module")
def mlx_seed() -> object:
    """The MLX delegate's blob of the fuzzer's cache-write program, with its call."""
    from writeback_testing.blobseeds import seeds_of

    return next(s for s in seeds_of("backend:mlx") if s.program == "cache-write#0")


def _mlx_init(seed: object, change: object) -> None:
    from writeback_mlx_backend import MLXDelegate
    from writeback_testing.blobmutants import codec_of

    codec = codec_of(seed.blob)  # type: ignore[attr-defined]  # a blobfuzz Seed
    assert codec is not None and codec.prefix
    tree = json.loads(json.dumps(codec.tree))
    change(tree)  # type: ignore[operator]  # a callable
    delegate = MLXDelegate()
    handle = delegate.init(codec.encode(tree), seed.specs)  # type: ignore[attr-defined]
    delegate.execute(handle, [a.clone() for a in seed.args])  # type: ignore[attr-defined]


@pytest.mark.slow
def test_mlx_input_shape_past_int32_is_blob_error_not_escaping_overflow_error(mlx_seed: object) -> None:
    """Found by the blob fuzzer (``backend:mlx`` seed 0 mutants 107, 118): an
    ``input_meta`` size past 2**31 reaches MLX as is and escapes as ``OverflowError``
    (``std::bad_cast`` as ``RuntimeError`` past 2**64)."""

    def change(tree: dict[str, list[dict[str, list[int]]]]) -> None:
        tree["input_meta"][0]["shape"][0] = 2**63 - 1

    with pytest.raises(BlobError, match=r"input_meta\[.*\]\.shape"):
        _mlx_init(mlx_seed, change)


@pytest.mark.filterwarnings("ignore::writeback_trt_copyback.declare.UninitializedCopyBackWarning")
@pytest.mark.parametrize("dim", [10**30, 4, -5])
def test_kv_alias_index_copy_dim_past_the_caches_rank_refused_by_name_nothing_written(dim: int) -> None:
    """Found by the blob fuzzer (``engine:kv-alias`` seed 0 mutant 74): an in-place
    ``index_copy`` update whose dim lies outside the cache's rank reached ``index_copy_`` as
    is (``ValueError: Overflow when unpacking long long`` for a huge one)."""
    from writeback_testing.blobseeds import seeds_of
    from writeback_trt_copyback.kv_alias_delegate import KVAliasRuntimeDelegate

    seed = next(s for s in seeds_of("engine:kv-alias") if s.program == "cache-write#0")
    tree = json.loads(seed.blob)
    updates = [step for step in tree["steps"] if step.get("update") == "index_copy"]
    assert updates, "the seed writes its cache with an in-place index_copy"
    updates[0]["dim"] = dim
    delegate = KVAliasRuntimeDelegate()
    if dim < 0:  # the blob reader takes no negative dim: refused at init, before any call
        with pytest.raises(BlobError, match=rf"steps\[\d+\]\.dim = {dim}: out of range"):
            delegate.init(json.dumps(tree).encode(), seed.specs)
        return
    handle = delegate.init(json.dumps(tree).encode(), seed.specs)
    args = [a.clone() for a in seed.args]
    with pytest.raises(IndexError, match=rf"index_copy update .*: its dim: dimension out of range .*but got {dim}\)"):
        delegate.execute(handle, args)
    for before, after in zip(seed.args, args, strict=True):
        assert torch.equal(before, after)
