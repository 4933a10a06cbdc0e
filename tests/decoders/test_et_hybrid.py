"""ExecuTorch's own hybrid examples, ``et-lfm2`` (a short-convolution layer) and ``et-qwen3.5``
(a gated DeltaNet layer), each beside an attention layer: built from the executorch wheel's
example code as ``et-llama`` is, lowered through the pipeline on xnnpack and portable, and run
for several greedy decode steps; every step's logits equal an independent eager copy's, and
every state the layers carry is found as a mutated buffer. Slow: a lowering takes 10-20 s."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from writeback.run import run_model
from writeback.session import assemble
from writeback_core.registry import load_registry

from tests.decoders.cases import call, fed

pytestmark = pytest.mark.slow

STEPS = 5
KV = {f"layers.1.attention.kv_cache.{kv}_cache" for kv in "kv"}
STATE = {
    "et-lfm2": {"layers.0.conv.conv_state", *KV},
    "et-qwen3.5": {"layers.0.attention.conv_state", "layers.0.attention.recurrent_state", *KV},
}


@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
@pytest.mark.parametrize("name", sorted(STATE))
def test_et_hybrid_runs_every_step_like_eager(name: str, backend: str, tmp_path: Path) -> None:
    registry = load_registry()
    case = registry.models()[name]
    report = run_model(assemble(registry, backend), case, STEPS, tmp_path / "model.pte")
    assert {m.target for m in report.lowered.mutations} == STATE[name]
    eager = case.build().eval()
    for step, (result, _) in enumerate(report.steps):
        expected = call(case, eager, step)
        torch.testing.assert_close(result.outputs[-1], expected, rtol=1e-4, atol=1e-4, msg=f"{name} step {step}")
    assert len({fed(case, s)[0] for s in range(STEPS)}) > 1
    assert not report.failures
    kept = {c.state: c.reason for c in report.lowered.copies_left}
    if backend == "portable" or name == "et-lfm2":
        # conv_state and recurrent_state written by the kernel that computes them; on xnnpack,
        # LFM2's conv_state by the delegate (its result planned onto the buffer).
        assert report.lowered.write_back_bytes == {}, kept
    for state, reason in kept.items():
        # Each copy left is named in the model's terms: the example's source line of the write.
        assert "short_conv.py:" in reason or "attention.py:" in reason, (state, reason)


@pytest.mark.parametrize("name", sorted(STATE))
def test_et_hybrid_is_built_from_the_wheels_example_layers(name: str) -> None:
    from executorch.examples.models.lfm2.short_conv import ShortConv
    from executorch.examples.models.llama.attention import ATTENTION_REGISTRY

    module = load_registry().models()[name].build()
    expected = ShortConv if name == "et-lfm2" else ATTENTION_REGISTRY["gated_deltanet"]
    assert any(type(m) is expected for m in module.modules())
    assert {n for n, _ in module.named_buffers()} >= STATE[name]


@pytest.mark.parametrize("name", sorted(STATE))
def test_et_hybrid_custom_ops_contender_matches_eager(name: str) -> None:
    """The stock lowering's contender: ExecuTorch's custom KV cache and SDPA ops on the same
    weights, step after step equal to eager."""
    case = load_registry().models()[name]
    program = case.contenders["et-custom-ops"]()
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any("llama.custom_sdpa" in t for t in targets), targets
    contender = program.module()
    eager = case.build().eval()
    for step in range(STEPS):
        with torch.no_grad():
            mine = contender(*case.step_inputs(step), **case.step_kwargs(step))
        torch.testing.assert_close(mine, call(case, eager, step), rtol=1e-4, atol=1e-4, msg=f"step {step}")
