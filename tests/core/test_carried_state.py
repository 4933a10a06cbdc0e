"""The state an eager model carries from call to call, and the refusal of a program that drops
any of it (writeback_core.carried_state), through the API every command exports with
(export_model): real torch.export, real modules; the expected states are worked out by hand."""

from __future__ import annotations

import pytest
import torch
from writeback_core.carried_state import StateLostError, carried_states, mutated_buffers
from writeback_core.exporting import export_model

from tests.core.lazy_state_model import DIM, LazyStateDecoder

TOKENS = (torch.tensor([[3]]), torch.tensor([0]))


def test_export_model_refuses_a_state_the_program_drops_naming_it_clear_error() -> None:
    with pytest.raises(StateLostError) as raised:
        export_model(LazyStateDecoder(), TOKENS, name="model 'lazy'")
    message = str(raised.value)
    assert message.startswith("model 'lazy': the exported program drops state the eager model carries")
    assert f"cache.state [1, 1, {DIM}] float32 (created by call 1, written in place by call 2; not a buffer)" in message
    assert "it keeps only calls" in message  # the counter it does keep is named as kept, not as lost
    assert "register_buffer" in message  # what to do
    assert [s.path for s in raised.value.states] == ["cache.state"]
    assert raised.value.kept == ["calls"]


def test_carried_states_finds_buffers_cache_objects_and_rebound_attributes() -> None:
    class Rebinding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steady", torch.ones(2))  # read, never written: no state
            self.total = torch.zeros(2)  # a plain attribute rebound every call

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total = self.total + x
            return self.total * self.steady

    found = {s.path: s.change for s in carried_states(Rebinding(), (torch.ones(2),))}
    assert found == {"total": "rebound to a new tensor by call 1, rebound to a new tensor by call 2"}
    found = {s.path: (s.change, s.buffers) for s in carried_states(LazyStateDecoder(registered=True), TOKENS)}
    assert found == {
        "calls": ("written in place by call 1, written in place by call 2", ("calls",)),
        "state": ("written in place by call 1, written in place by call 2", ("state",)),
    }


def test_export_model_accepts_a_model_whose_state_the_program_keeps_no_false_refusal() -> None:
    program = export_model(LazyStateDecoder(registered=True), TOKENS)
    assert mutated_buffers(program) == ["calls", "state"]


def test_export_model_accepts_a_model_without_state_no_false_refusal() -> None:
    export_model(torch.nn.Linear(4, 2), (torch.ones(1, 4),))


def test_the_eager_calls_leave_the_users_module_and_inputs_as_they_were() -> None:
    module = LazyStateDecoder(registered=True)
    counter, state = module.calls, module.state
    tokens, positions = TOKENS[0].clone(), TOKENS[1].clone()
    versions = (counter._version, state._version, tokens._version)
    carried_states(module, (tokens, positions))
    assert module.calls is counter and module.state is state and module.cache.state is None
    assert (counter._version, state._version, tokens._version) == versions
    assert int(counter) == 0 and not state.any()
    assert tokens.tolist() == [[3]] and positions.tolist() == [0]
    lazy = LazyStateDecoder()
    carried_states(lazy, TOKENS)
    assert lazy.cache.state is None and int(lazy.calls) == 0


def test_a_module_that_cannot_be_copied_is_checked_in_place_and_left_as_it_was() -> None:
    import threading

    module = LazyStateDecoder()
    module.lock = threading.Lock()  # type: ignore[assignment]  # deepcopy cannot copy a lock
    counter = module.calls
    found = {s.path: s.buffers for s in carried_states(module, TOKENS)}
    assert found == {"calls": ("calls",), "cache.state": ()}
    assert module.cache.state is None and module.calls is counter and int(counter) == 0
    with pytest.raises(StateLostError, match=r"cache\.state \[1, 1, 8\] float32"):
        export_model(module, TOKENS)


class _CounterThroughTo(torch.nn.Module):
    """Writes its counter through ``.to`` of its own device and dtype, as transformers' static
    cache layer does after lazy initialisation: eager ``to`` returns the buffer itself, and
    torch.export keeps the ``to`` as an alias, so the ``add_`` writes the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = self.count.to(self.count.device)
        count.add_(1)
        return x * count


def test_a_buffer_written_through_an_alias_of_it_counts_as_kept_no_false_refusal() -> None:
    program = export_model(_CounterThroughTo(), (torch.ones(2),))
    assert mutated_buffers(program) == ["count"]
    # The program it decomposes to does write the counter: the state the check saw is real.
    decomposed = program.run_decompositions({})
    assert list(decomposed.graph_signature.buffers_to_mutate.values()) == ["count"]


class _Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(x)
        return self.count * 2


def test_a_forward_closing_over_the_original_leaves_the_users_buffers_as_they_were() -> None:
    """ExecuTorch's example wrappers replace ``forward`` on the instance by a closure over the
    module: a deep copy keeps that same function, so the check's eager calls reach the original."""
    module = _Counter()
    inner = module.forward

    def closing_over(x: torch.Tensor) -> torch.Tensor:
        return inner(x)

    module.forward = closing_over  # type: ignore[method-assign]
    export_model(module, (torch.ones(2),))
    assert torch.equal(module.count, torch.zeros(2)), module.count
