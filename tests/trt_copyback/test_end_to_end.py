"""Done-when: a KV cache (aliased), a Gated-DeltaNet state and an EMA (copy-back), 8 steps, real runtime."""

from __future__ import annotations

import warnings

import pytest
import torch
from writeback_trt_copyback import KVAliasEngine, Mode, UninitializedCopyBackWarning, compile_for_engine

from tests.trt_copyback.conftest import EngineRun, export, note
from tests.trt_copyback.models import Hybrid, hybrid_inputs

KV = ["decoder.blocks.0.k_cache", "decoder.blocks.0.v_cache"]
COPY_BACK = ["ema.running_mean", "ema.steps", "gdn.conv_state", "gdn.recurrent_state"]


def _compile(mode: Mode) -> tuple[object, list[warnings.WarningMessage]]:
    program = export(Hybrid(), hybrid_inputs(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UninitializedCopyBackWarning)
        compiled = compile_for_engine(program, KVAliasEngine(), mode=mode)
    return compiled, [w for w in caught if issubclass(w.category, UninitializedCopyBackWarning)]


# KEEP_ALL keeps every engine output the same way PREDICT does for the aliased ones: slow tier.
@pytest.mark.parametrize("mode", [Mode.PREDICT, pytest.param(Mode.KEEP_ALL, marks=pytest.mark.slow)])
def test_kv_aliased_gdn_and_ema_copied_back_match_eager_for_8_steps(mode: Mode) -> None:
    compiled, caught = _compile(mode)
    assert compiled.aliased == KV  # type: ignore[attr-defined]
    assert compiled.copy_back == COPY_BACK  # type: ignore[attr-defined]
    assert len(caught) == 1 and "'ema.running_mean'" in str(caught[0].message)
    placeholders = [b.placeholder for b in compiled.lifted.buffers]  # type: ignore[attr-defined]
    run = EngineRun(compiled, init_buffers=placeholders)  # type: ignore[arg-type]
    eager = Hybrid().eval()
    for step in range(8):
        inputs = hybrid_inputs(step)
        logits, centered = run(*inputs)
        with torch.no_grad():
            want_logits, want_centered = eager(*inputs)
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(centered, want_centered)
        for name, want in eager.named_buffers():
            torch.testing.assert_close(run.buffer(name), want, msg=note(name))
    # The KV caches are written in place: the program has no write-back copy for them.
    copies = [n for n in run.program.graph.nodes if n.op == "call_function" and "copy_" in str(n.target)]
    written = sorted(str(n.args[0].target) for n in copies)
    assert written == ["b_ema_running_mean", "b_ema_steps", "b_gdn_conv_state", "b_gdn_recurrent_state"]


def test_every_buffer_and_parameter_stays_the_programs_own_not_the_engines() -> None:
    """The partitioner never tags a placeholder: an aliased cache is written in the program's
    own buffer, which the caller can read, and weights stay program constants."""
    compiled, _ = _compile(Mode.PREDICT)
    signature = compiled.to_executorch().exported_program().graph_signature  # type: ignore[attr-defined]
    model = Hybrid()
    assert set(dict(model.named_buffers())) <= set(signature.inputs_to_buffers.values())
    assert set(dict(model.named_parameters())) <= set(signature.inputs_to_parameters.values())
