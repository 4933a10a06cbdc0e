"""The ExecuTorch Llama example (``k_out[:, :, input_pos] = k_val``, the form exir's own reinplace
pass breaks at run time) lowered with ``--backend portable`` and ``--backend xnnpack``: every KV
cache written in place by ``index_put_``, no whole-cache write-back left, and every step of stock
``executorch.runtime`` equal to eager PyTorch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from writeback_core import load_registry
from writeback_core.exporting import export_model
from writeback_core.lowering import lower
from writeback_passes import plugin as passes_plugin

LAYERS = 2
STEPS = 6


def _llama() -> torch.nn.Module:
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    torch.manual_seed(0)
    args = ModelArgs(
        dim=32,
        n_layers=LAYERS,
        n_heads=2,
        n_kv_heads=2,
        vocab_size=64,
        max_seq_len=32,
        max_context_len=32,
        max_batch_size=1,
        use_kv_cache=True,
    )
    return construct_transformer(args).eval()


def _inputs(step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return torch.tensor([[(7 * step + 3) % 64]]), {"input_pos": torch.tensor([step])}


def _count(plan: Any, name: str) -> int:
    """How many instructions of the emitted plan call operator ``name``."""
    ids = {i for i, op in enumerate(plan.operators) if op.name == name}
    calls = (getattr(ins.instr_args, "op_index", None) for chain in plan.chains for ins in chain.instructions)
    return sum(1 for index in calls if index in ids)


@pytest.mark.slow  # builds, lowers and runs a two-layer transformer
@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_et_llama_index_put_form_runs_in_stock_runtime_with_no_whole_cache_copy(backend: str) -> None:
    from executorch.runtime import Runtime

    model = _llama()
    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    lowered = lower(export_model(copy.deepcopy(model), _inputs(0)), registry, registry.backends()[backend], "planned")
    caches = [t for t, d in lowered.decisions.items() if t.endswith(("k_cache", "v_cache"))]
    assert len(caches) == 2 * LAYERS
    assert all(lowered.decisions[t].accepted for t in caches), lowered.decisions
    plan = lowered.program.executorch_program.execution_plan[0]
    assert _count(plan, "aten::copy_") == 0
    assert _count(plan, "aten::index_put_") == 2 * LAYERS
    program = Runtime.get().load_program(lowered.pte)  # kept alive: its methods read its memory
    method = program.load_method("forward")
    for step in range(STEPS):
        tokens, options = _inputs(step)
        got = method.execute([tokens, options["input_pos"]])[0]
        with torch.no_grad():
            want = model(tokens, options)
        want = want[0] if isinstance(want, tuple) else want
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"logits of step {step}")
        for target in caches:
            cache = method._method.get_attribute(target)
            eager = model.get_buffer(target)
            torch.testing.assert_close(cache, eager, rtol=1e-4, atol=1e-4, msg=f"{target} after step {step}")
