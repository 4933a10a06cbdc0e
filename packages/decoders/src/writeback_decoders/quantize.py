"""Weight quantization of a decoder before export: what ExecuTorch's Llama export calls ``8da4w``.

``8da4w``: every ``nn.Linear`` whose input width divides by the group size gets 4-bit
weights in groups of ``group_size`` along the input (symmetric, one scale per group) and
8-bit activations quantized per token at run time, through torchao's
``Int8DynamicActivationIntxWeightConfig``. XNNPACK's partitioner takes the resulting
pattern as its dynamically quantized linear. Embeddings and norms stay as they were;
the state (the KV cache) is untouched, so every in-place write of the fp32 model is
still in place.

torchao comes with ExecuTorch (exir imports it); nothing here is imported until a
model is quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["QUANTIZATIONS", "Quantization", "QuantizationError", "quantize", "scheme"]


class QuantizationError(ValueError):
    """A scheme this package does not offer, or a model with nothing it can quantize."""


@dataclass(frozen=True)
class Quantization:
    """A scheme's name, what it does, and how far its arithmetic may stray from fp32's
    run of the same quantized model (XNNPACK's int8 kernels against torchao's eager
    reference: the activations' rounding differs in the last step)."""

    name: str
    description: str
    group_size: int
    rtol: float
    atol: float


QUANTIZATIONS: dict[str, Quantization] = {
    "8da4w": Quantization(
        "8da4w",
        "linear layers: 8-bit dynamic activations, 4-bit weights in groups of 32 (torchao "
        "Int8DynamicActivationIntxWeightConfig); embeddings fp32",
        group_size=32,
        # Measured on the tiny and 4-layer hf Llama cases: logits within 2e-2 of torchao's
        # eager, caches within 1e-2 (an activation rounded to the next int8 step).
        rtol=5e-2,
        atol=5e-2,
    ),
}


def scheme(name: str, hidden: int | None = None) -> Quantization:
    """The scheme called ``name``; with ``hidden`` (a decoder's hidden size), checked to fit it.

    :raises QuantizationError: no such scheme, or ``hidden`` does not divide by its group size.
    """
    if name in QUANTIZATIONS and hidden is not None and hidden % QUANTIZATIONS[name].group_size:
        raise QuantizationError(
            f"{name}: hidden size {hidden} does not divide by the group size {QUANTIZATIONS[name].group_size}, "
            "so the attention and MLP input layers would stay fp32"
        )
    try:
        return QUANTIZATIONS[name]
    except KeyError:
        raise QuantizationError(f"unknown quantization {name!r}; offered: {', '.join(sorted(QUANTIZATIONS))}") from None


def quantize(module: nn.Module, name: str) -> nn.Module:
    """Quantize ``module``'s linear layers in place as the scheme ``name`` says; returns ``module``.

    :raises QuantizationError: no scheme is called ``name``, or no linear layer's input width
        divides by the scheme's group size (nothing would be quantized).
    """
    chosen = scheme(name)
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    fits = [m for m in linears if m.in_features % chosen.group_size == 0]
    if not fits:
        widths = sorted({m.in_features for m in linears})
        raise QuantizationError(
            f"{name}: no linear layer's input width divides by the group size {chosen.group_size} "
            f"(widths {widths or 'none: the model has no nn.Linear'}); the model would stay fp32"
        )
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4,  # type: ignore[attr-defined]  # in torch, missing from its stubs
        weight_granularity=PerGroup(chosen.group_size),
    )
    chosen_ids = {id(m) for m in fits}
    quantize_(module, config, filter_fn=lambda m, _fqn: id(m) in chosen_ids)
    return module
