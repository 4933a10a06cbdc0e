"""Exporting a model: ``torch.export`` as every writeback command and harness does it.

- :func:`export_model`: ``torch.export`` in eval mode under ``no_grad``, refusing state
  that export lifted as constants (:func:`check_lifted_state`), an op no ExecuTorch program
  holds (:mod:`writeback_core.core_aten`) and state the program drops
  (:mod:`writeback_core.carried_state`).
- :func:`check_lifted_state`: a program holding the model's state as lifted constants is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from writeback_core.carried_state import carried_states, check_state_kept
from writeback_core.core_aten import check_core_aten
from writeback_core.ops import written_placeholders
from writeback_core.quiet import known_warnings_ignored
from writeback_core.types import LoweringError

__all__ = ["check_lifted_state", "export_model"]


def export_model(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
    dynamic_shapes: Any = None,
    name: str | None = None,
) -> ExportedProgram:
    """``torch.export.export`` of ``module`` in eval mode, without grad, quietly.

    The one export helper of writeback: every command and test harness exports
    through it, so they all see the same graph. ``name`` (the model's) is what an
    error names; default: the module's class.

    Before exporting, a copy of ``module`` is called twice at the example inputs to find
    the state it carries from call to call
    (:func:`~writeback_core.carried_state.carried_states`); ``module`` is left as it was.

    :raises LoweringError: the program holds state as lifted constants (see
        :func:`check_lifted_state`): lowering it would fail or answer wrongly.
    :raises writeback_core.core_aten.OpsOutsideCoreAtenError: the program computes an op
        outside Core ATen that ``to_edge`` cannot decompose (no ExecuTorch program holds it).
    :raises writeback_core.carried_state.StateLostError: the program drops state the
        eager module carries (see :func:`~writeback_core.carried_state.check_state_kept`).
    """
    _eval_mode(module)
    what = name or f"module {type(module).__name__}"
    # Before exporting: a non-strict export runs forward on the module itself, and what it
    # leaves behind (a cache allocated while tracing) is not the model's state.
    # Eager PyTorch may refuse the example inputs themselves (an index out of range that the
    # program is exported to refuse at run time, as eager does): with no eager call to compare,
    # the program is exported as before and no state is checked.
    states: list[Any] | None
    try:
        with known_warnings_ignored():
            states = carried_states(module, args, kwargs)
    except Exception:  # whatever the model's forward raises at these inputs
        states = None
    with known_warnings_ignored(), torch.no_grad():
        program = torch.export.export(module, args, dict(kwargs or {}), strict=strict, dynamic_shapes=dynamic_shapes)
    check_lifted_state(program, module, what, strict)
    check_core_aten(program, what)
    if states is not None:
        check_state_kept(program, states, what)
    return program


def _eval_mode(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in eval mode without grad, in place. Not chained: a PT2E-converted model
    (``allow_exported_model_train_eval``) returns ``None`` from ``eval()``."""
    module.eval()
    module.requires_grad_(False)
    return module


def _storage(tensor: Any) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr()) if isinstance(tensor, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):  # a tensor without real storage (fake, meta)
        return None


def check_lifted_state(
    program: ExportedProgram, module: torch.nn.Module | None, what: str, strict: bool | None
) -> None:
    """Refuse a program that holds the model's state as lifted tensor constants.

    Non-strict ``torch.export`` lifts a tensor that ``forward`` reaches other than as a
    registered buffer (a list of cache tensors, as Hugging Face's ``StaticCache`` keeps
    them) as a constant, even when it shares storage with a registered buffer. Writes to
    it are then no buffer mutation: the state would never persist (or lowering fails
    deep in AOTAutograd, ``expected compiled_fn to be GraphModule``), and a constant that
    aliases a buffer is a stale copy of it in the ``.pte``.

    :param module: the exported module, whose buffers the constants are checked
        against (``None``: only writes to constants are looked for).
    :param what: what the error names (``model 'name'``).
    :param strict: how the program was exported (``None``: not known), for the advice.
    :raises LoweringError: a lifted constant is written by the graph or shares storage
        with a registered buffer; the message names each and what to do.
    """
    lifted = program.graph_signature.inputs_to_lifted_tensor_constants
    if not lifted:
        return
    written = written_placeholders(program.graph_module.graph)
    buffers: dict[int, str] = {}
    if module is not None:
        for buffer_name, buffer in module.named_buffers(remove_duplicate=False):
            pointer = _storage(buffer)
            if pointer is not None and pointer != 0:
                buffers.setdefault(pointer, buffer_name)
    problems = []
    for placeholder, constant in lifted.items():
        reasons = []
        if placeholder in written:
            reasons.append(f"written by {written[placeholder]}")
        shared = buffers.get(_storage(program.constants.get(constant)) or 0)
        if shared is not None:
            reasons.append(f"shares storage with registered buffer {shared!r}")
        if reasons:
            problems.append(f"{constant} ({', '.join(reasons)})")
    if not problems:
        return
    advice = (
        "export strictly: strict=True (ModelCase(strict=True, ...), as Hugging Face's ExecuTorch integration does)"
        if strict is not True
        else "the export was strict already"
    )
    raise LoweringError(
        f"{what}: torch.export lifted tensors of the model's state as constants, not buffers: "
        f"{'; '.join(problems)}. Writes to them would not persist across calls (to_edge fails in AOTAutograd). "
        f"Fix: {advice}, or register those tensors as buffers of the module (register_buffer) and "
        "have forward write the buffers themselves.",
        upstream=True,
    )
