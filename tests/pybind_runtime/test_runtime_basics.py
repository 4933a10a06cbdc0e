"""Loading and running programs: outputs against eager PyTorch, metadata, bad programs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from writeback_pybind_runtime import Method, ProgramError, Runtime

from tests.pybind_runtime.conftest import Lower


class AddMul(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + y, x * y


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_outputs_match_eager(lower: Lower, load: Callable[[bytes], Method], planned: bool) -> None:
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    method = load(lower(AddMul(), (x, y), planned_inputs=planned, planned_outputs=planned))
    for step in range(3):
        a, b = torch.randn(3, 4), torch.randn(3, 4) + step
        out = method([a, b])
        torch.testing.assert_close(out[0], a + b)
        torch.testing.assert_close(out[1], a * b)


def test_load_from_path_and_bytes_agree(lower: Lower, runtime: Runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pte = lower(AddMul(), (torch.randn(2), torch.randn(2)))
    path = tmp_path / "add_mul.pte"
    path.write_bytes(pte)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    from_path = runtime.load_program(path).load_method("forward")
    from_str = runtime.load_program(str(path)).load_method("forward")
    from_bytes = runtime.load_program(pte).load_method("forward")
    for method in (from_path, from_str, from_bytes):
        assert [t.tolist() for t in method([a, b])] == [[4.0, 6.0], [3.0, 8.0]]


def test_method_names_and_metadata(lower: Lower, runtime: Runtime) -> None:
    program = runtime.load_program(lower(AddMul(), (torch.randn(2, 5), torch.randn(2, 5))))
    assert program.method_names == {"forward"}
    meta = program.load_method("forward").metadata
    assert meta.name == "forward"
    assert (meta.num_inputs, meta.num_outputs) == (2, 2)
    assert meta.inputs[0].dtype == "float32" and meta.inputs[0].sizes == (2, 5)
    assert meta.outputs[1].nbytes == 2 * 5 * 4
    assert all(o.is_input is None for o in meta.outputs)


def test_unknown_method_is_a_program_error_naming_it(lower: Lower, runtime: Runtime) -> None:
    program = runtime.load_program(lower(AddMul(), (torch.randn(2), torch.randn(2))))
    with pytest.raises(ProgramError, match=r"'backward'.*forward"):
        program.load_method("backward")


def test_garbage_bytes_are_a_program_error(runtime: Runtime) -> None:
    with pytest.raises(ProgramError, match=r"cannot load the program bytes"):
        runtime.load_program(b"definitely not a program")


def test_missing_file_is_a_program_error_naming_it(runtime: Runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "missing.pte"
    with pytest.raises(ProgramError, match=r"missing.pte"):
        runtime.load_program(missing)


def test_wrong_dtype_input_names_input_expected_and_actual(lower: Lower, load: Callable[[bytes], Method]) -> None:
    method = load(lower(AddMul(), (torch.randn(2), torch.randn(2))))
    with pytest.raises(ValueError, match=r"input 1 .*expected dtype float32, got int64"):
        method.set_inputs([torch.randn(2), torch.ones(2, dtype=torch.int64)])


def test_wrong_input_count_names_both(lower: Lower, load: Callable[[bytes], Method]) -> None:
    method = load(lower(AddMul(), (torch.randn(2), torch.randn(2))))
    with pytest.raises(ValueError, match=r"takes 2 inputs, got 1"):
        method.set_inputs([torch.randn(2)])


def test_non_tensor_for_tensor_input_is_a_type_error(lower: Lower, load: Callable[[bytes], Method]) -> None:
    method = load(lower(AddMul(), (torch.randn(2), torch.randn(2))))
    with pytest.raises(TypeError, match=r"input 0 .*must be a tensor.*got list"):
        method.set_inputs([[1.0, 2.0], torch.randn(2)])


def test_non_contiguous_input_that_is_only_read_is_accepted(lower: Lower, load: Callable[[bytes], Method]) -> None:
    method = load(lower(AddMul(), (torch.randn(3, 2), torch.randn(3, 2)), planned_inputs=False))
    a = torch.randn(2, 3).t()
    b = torch.randn(3, 2)
    out = method([a, b])
    torch.testing.assert_close(out[0], a + b)


def test_requires_grad_input_is_accepted(lower: Lower, load: Callable[[bytes], Method]) -> None:
    method = load(lower(AddMul(), (torch.randn(2), torch.randn(2))))
    a = torch.randn(2, requires_grad=True)
    b = torch.randn(2)
    out = method([a, b])
    torch.testing.assert_close(out[0], (a + b).detach())
    assert not out[0].requires_grad


class ManyDtypes(torch.nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(), i * 2, b & (x > 0), x.to(torch.bfloat16) * 2, x.half()


@pytest.mark.parametrize("clone", [True, False], ids=["cloned", "uncloned"])
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
def test_dtypes_and_zero_dim_outputs_match_eager(
    lower: Lower, load: Callable[[bytes], Method], planned: bool, clone: bool
) -> None:
    args = (torch.randn(3), torch.tensor([1, 2]), torch.tensor([True, False, True]))
    method = load(lower(ManyDtypes(), args, planned_inputs=planned, planned_outputs=planned))
    inputs = (torch.tensor([1.0, -2.0, 3.0]), torch.tensor([3, 4]), torch.tensor([True, True, False]))
    got = method(list(inputs), clone_outputs=clone)
    want = ManyDtypes()(*inputs)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


class _ReadBeforeWrite(torch.nn.Module):
    """A running sum read before it is written: exir serializes only its shape and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = self.total * 1.0
        self.total.add_(x)
        return before


def test_planned_mutable_buffer_starts_at_zero_like_stock(lower: Lower, runtime: Runtime) -> None:
    from executorch.runtime import Runtime as StockRuntime

    pte = lower(_ReadBeforeWrite(), (torch.ones(4),))
    ours = runtime.load_program(pte).load_method("forward")
    stock = StockRuntime.get().load_program(pte).load_method("forward")
    eager = _ReadBeforeWrite()
    for step in range(3):
        x = torch.full((4,), float(step + 1))
        expected = eager(x)
        torch.testing.assert_close(ours.execute([x])[0], expected)
        torch.testing.assert_close(stock.execute([x])[0], expected)
