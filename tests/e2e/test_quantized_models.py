"""A PT2E-quantized decoder (XNNPACKQuantizer, dynamic per-channel int8 linears) runs through
`writeback run` with no delegate and with the MLX delegate: writeback loads ExecuTorch's
quantized kernels itself when the graph runs ``quantized_decomposed`` ops outside a delegate
(no ``import executorch.kernels.quantized`` in the model file). The `.pte` is stepped again
here and compared with the eager quantized model computed here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main
from writeback.session import assemble
from writeback_core.registry import load_registry

# The projections are quantized one by one and the decoder holds them: re-exporting a whole
# PT2E-converted model loses its state writes (torch.export keeps a converted graph's in-place
# index_copy_ of an input or buffer as no mutation at all), so the quantized parts are
# submodules of a module whose forward writes the cache.
MODEL_FILE = """
import torch
from torch import nn
from torchao.quantization.pt2e import allow_exported_model_train_eval
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
    XNNPACKQuantizer,
    get_symmetric_quantization_config,
)
from writeback_core.types import ModelCase

DIM, SLOTS = 16, 6


def quantized_linear(seed):
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(DIM, DIM).eval()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(DIM, DIM, generator=gen) / 4)
        layer.bias.copy_(torch.randn(DIM, generator=gen) / 4)
        graph = torch.export.export(layer, (torch.randn(1, DIM, generator=gen),)).module()
    config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
    prepared = prepare_pt2e(graph, XNNPACKQuantizer().set_global(config))
    prepared(torch.randn(1, DIM, generator=gen))
    converted = convert_pt2e(prepared)
    allow_exported_model_train_eval(converted)
    return converted


class QuantizedDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (quantized_linear(seed) for seed in range(4))
        self.register_buffer("k_cache", torch.zeros(SLOTS, DIM))
        self.register_buffer("v_cache", torch.zeros(SLOTS, DIM))

    def forward(self, x, pos):
        self.k_cache.index_copy_(0, pos, self.k(x))
        self.v_cache.index_copy_(0, pos, self.v(x))
        weights = torch.softmax(self.q(x) @ self.k_cache.t() / DIM**0.5, dim=-1)
        return self.o(weights @ self.v_cache) + x


def inputs(step):
    x = torch.randn(1, DIM, generator=torch.Generator().manual_seed(100 + step))
    return (x, torch.tensor([step % SLOTS]))


def make():
    return ModelCase(name="quantized-decoder", description="PT2E dynamic per-channel int8 linears",
                     build=QuantizedDecoder, step_inputs=inputs)
"""

STEPS = 8  # past the 6 slots: slots are overwritten


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("quantized_decoder_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_and_step_again(tmp_path: Path, backend: str) -> None:
    source = tmp_path / "quantized_decoder.py"
    source.write_text(MODEL_FILE)
    pte = tmp_path / "quantized.pte"
    result = CliRunner().invoke(
        main, ["run", f"{source}:make", "--backend", backend, "--steps", str(STEPS), "--output", str(pte)]
    )
    assert result.exit_code == 0, result.output
    assert "Missing out variants" not in result.output
    assert f"all {STEPS} steps match eager PyTorch" in result.output

    model = _load(source)
    eager = model.QuantizedDecoder()
    pipeline = assemble(load_registry(), backend)
    method = pipeline.runtime.load_program(pte.read_bytes(), pipeline.delegates).load_method("forward")
    for step in range(STEPS):
        x, pos = model.inputs(step)
        (got,) = method.execute([x, pos])
        with torch.no_grad():
            expected = eager(x, pos)
        # The output reads every slot of both caches: a lost or misplaced write shows.
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # PT2E quantization of four linears and a lowering: about 20 s
def test_pt2e_quantized_decoder_on_no_delegate_loads_the_quantized_kernels_and_matches_eager(tmp_path: Path) -> None:
    _run_and_step_again(tmp_path, "none")


@pytest.mark.slow
def test_pt2e_quantized_decoder_on_mlx_matches_eager(tmp_path: Path) -> None:
    pytest.importorskip("writeback_mlx_backend")
    _run_and_step_again(tmp_path, "mlx")
