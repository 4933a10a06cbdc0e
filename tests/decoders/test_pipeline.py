"""Each real decoder, tiny, exported through writeback.model_build.export_case as its case says
(strict keyword inputs for the Hugging Face models), lowered and run for several greedy decode
steps through the pipeline on backends none and mlx: every step's logits equal an eager copy's,
every cache of every layer found as a mutated buffer. Slow: each lowering takes 20-60 s here."""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch
from executorch.exir import memory
from executorch.exir.delegate import executorch_call_delegate
from writeback.model_build import export_case
from writeback.run import run_model
from writeback.session import assemble, lower_case
from writeback_core.mutations import find_mutations
from writeback_core.registry import load_registry
from writeback_decoders import hf_case, hf_config

from tests.decoders.cases import call, fed

pytestmark = pytest.mark.slow

STEPS = 5

# The state each model's program must mutate: every layer's K and V cache (and the
# integration's per-layer fill counter).
STATE = {
    "et-llama": {f"layers.{i}.attention.kv_cache.{kv}_cache" for i in range(2) for kv in "kv"},
    **{
        name: {f"{kind}_{i}" for i in range(2) for kind in ("key_cache", "value_cache", "cumulative_length")}
        for name in ("hf-llama", "hf-qwen3", "hf-gemma")
    },
}


@pytest.mark.parametrize("backend", ["none", "mlx"])
@pytest.mark.parametrize("name", sorted(STATE))
def test_real_decoder_runs_every_step_like_eager(name: str, backend: str, tmp_path: Path) -> None:
    registry = load_registry()
    case = registry.models()[name]
    report = run_model(assemble(registry, backend), case, STEPS, tmp_path / "model.pte")
    assert {m.target for m in report.lowered.mutations} == STATE[name]
    eager = case.build().eval()
    for step, (result, _) in enumerate(report.steps):
        expected = call(case, eager, step)
        torch.testing.assert_close(result.outputs[-1], expected, rtol=1e-4, atol=1e-4, msg=f"{name} step {step}")
    assert [fed(case, s)[1] for s in range(STEPS)] == list(range(STEPS))
    assert len({fed(case, s)[0] for s in range(STEPS)}) > 1
    assert not report.failures


def test_hf_export_is_strict_with_keyword_inputs_and_mutates_the_cache() -> None:
    case = load_registry().models()["hf-llama"]
    program = export_case(case)
    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert names == ["input_ids", "cache_position"]
    mutated = {m.target for m in find_mutations(program.run_decompositions())}
    assert mutated == STATE["hf-llama"]


def test_integration_export_runs_like_eager(tmp_path: Path) -> None:
    """transformers' own TorchExportableModuleForDecoderOnlyLM.export handed over as the program."""
    case = hf_case(hf_config("llama"), name="hf-llama-integration", integration_export=True)
    assert case.exported is not None
    registry = load_registry()
    report = run_model(assemble(registry, "none"), case, 3, tmp_path / "model.pte")
    eager = case.build().eval()
    for step, (result, _) in enumerate(report.steps):
        torch.testing.assert_close(result.outputs[-1], call(case, eager, step), rtol=1e-4, atol=1e-4)
    assert not report.failures


def test_et_custom_ops_contender_takes_the_same_inputs_and_matches_eager() -> None:
    """ExecuTorch's own custom KV-cache and SDPA export of et-llama: the same weights, the same
    inputs (tokens, input_pos), the same logits step after step."""
    case = load_registry().models()["et-llama"]
    program = case.contenders["et-custom-ops"]()
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any("llama.custom_sdpa" in t for t in targets), targets
    assert any("llama.update_cache" in t for t in targets), targets
    contender = program.module()
    eager = case.build().eval()
    for step in range(STEPS):
        with torch.no_grad():
            mine = contender(*case.step_inputs(step), **case.step_kwargs(step))
        torch.testing.assert_close(mine, call(case, eager, step), rtol=1e-4, atol=1e-4, msg=f"step {step}")


# Architectures beyond the built-in three, tiny (2 layers, hidden 64, 4 heads of 16, 2 KV
# heads, 32 positions). Phi-3 and GLM fuse the MLP's gate and up projections and split
# them with ``chunk(2)``: a kernel writing a list of tensors, which the runtime's loader
# once refused. StableLM normalizes with LayerNorm (bias included).
OTHER_ARCHITECTURES = {"phi3": "Phi3Config", "glm": "GlmConfig", "stablelm": "StableLmConfig"}


@pytest.mark.parametrize("backend", ["none", "mlx"])
@pytest.mark.parametrize("architecture", sorted(OTHER_ARCHITECTURES))
def test_more_hugging_face_architectures_run_every_step_like_eager(
    architecture: str, backend: str, tmp_path: Path
) -> None:
    import transformers

    config = getattr(transformers, OTHER_ARCHITECTURES[architecture])(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    case = hf_case(config, max_cache_len=32)
    report = run_model(assemble(load_registry(), backend), case, STEPS, tmp_path / "model.pte")
    assert {m.target for m in report.lowered.mutations} >= {
        f"{kind}_{i}" for i in range(2) for kind in ("key_cache", "value_cache")
    }
    eager = case.build().eval()
    for step, (result, _) in enumerate(report.steps):
        expected = call(case, eager, step)
        torch.testing.assert_close(
            result.outputs[-1], expected, rtol=1e-4, atol=1e-4, msg=f"{architecture} on {backend}, step {step}"
        )
    assert not report.failures
    if backend == "mlx":  # every op in the delegate: LayerNorm and the chunked MLP included
        # run_model released its lowering before the steps: lower again to read the graph.
        graph = lower_case(case, assemble(load_registry(), backend)).program.exported_program().graph
        outside = [
            str(n.target)
            for n in graph.nodes
            if n.op == "call_function" and n.target not in (executorch_call_delegate, operator.getitem, memory.alloc)
        ]
        assert not outside, outside
