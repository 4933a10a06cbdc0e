"""What a decoder case feeds and holds, read from its inputs and its module (shared by the tests)."""

from __future__ import annotations

import torch
from writeback_core.types import ModelCase


def call(case: ModelCase, module: torch.nn.Module, step: int) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = module(*case.step_inputs(step), **case.step_kwargs(step))
    return out


def fed(case: ModelCase, step: int) -> tuple[int, int]:
    """(token, position) the case feeds at ``step``, read from its inputs."""
    args, kwargs = case.step_inputs(step), case.step_kwargs(step)
    if "input_ids" in kwargs:
        return int(kwargs["input_ids"]), int(kwargs["cache_position"])
    return int(args[0]), int(kwargs["attn_options"]["input_pos"])


def cache_bytes(module: torch.nn.Module) -> int:
    return sum(
        b.numel() * b.element_size()
        for name, b in module.named_buffers()
        if name.rsplit(".", 1)[-1].startswith(("k_cache", "v_cache", "key_cache", "value_cache"))
    )
