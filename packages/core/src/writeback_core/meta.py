"""Every ``node.meta`` key writeback reads or writes, in one place.

Plain ``node.meta`` keys are dropped when exir retraces (``to_edge``); entries of
the ``node.meta["custom"]`` dict survive ``to_edge``, partitioning, lowering and
``to_executorch``. Keys that must outlive a retrace therefore live under
:data:`CUSTOM`; keys only used inside one pass live directly in ``node.meta``.
"""

from __future__ import annotations

from typing import Any

import torch.fx

# The dict exir carries through every retrace; our durable keys live inside it.
CUSTOM = "custom"

# On a mutated placeholder: the in-place decision record (a plain dict, see
# ``writeback_core.registry.InPlaceDecision.to_meta``). Written by core when a
# partitioner asks; read by the passes that drop write-backs and by ``explain``.
IN_PLACE = "writeback.in_place"

# On a graph output value: this output is a copy-back value of a buffer that an
# engine must not alias. Written by trt-copyback; checked after lowering.
NO_ALIAS = "writeback.no_alias"

# On placeholders/values: which engine-aliased class a trt-copyback write got.
# Written by trt-copyback classification; read by its cross-check and explain.
COPY_BACK_CLASS = "writeback.copy_back_class"

# On a placeholder: True when it is a user input (caller memory), not a buffer.
# Written by writeback_passes.to_executorch from the signature (exir's passes
# see only a GraphModule); read by early write-back's output renaming.
USER_INPUT = "writeback.user_input"

# On a write-back ``copy_`` a pass kept: why no kernel writes the state in place, in the
# model's terms (module path and source line). Written by the passes; read by
# ``writeback_core.copies`` for ``run``, ``export`` and ``CopyLeftWarning``.
COPY_LEFT_REASON = "writeback.copy_left_reason"

# On a mutated placeholder: where the kernel that now writes the whole state into its own
# memory comes from in the model (module path and source line). Written by the passes.
WRITTEN_BY = "writeback.written_by"

# Not a node.meta key but the same kind of contract: the compile spec
# ``writeback_passes.reinplace_delegate_input_mutations`` adds to a lowered
# module when it drops write-backs, JSON ``[{"output": j, "input": i}]`` (the
# delegate's output j is unread and must be written into its input i in place).
# Written by the passes; read by every runtime delegate that writes in place.
IN_PLACE_OUTPUTS_SPEC = "writeback.in_place_outputs"

# exir's reinplace pass marks a node whose output must share its allocation
# with ``node.args[idx]``; it is an alias edge that no schema shows.
EXIR_SHARE_ALLOC = "_share_alloc_with_arg_idx"


def get_custom(node: torch.fx.Node, key: str) -> Any:
    """Return ``node.meta["custom"][key]`` or ``None`` when absent."""
    custom = node.meta.get(CUSTOM)
    if not isinstance(custom, dict):
        return None
    return custom.get(key)


def set_custom(node: torch.fx.Node, key: str, value: Any) -> None:
    """Set ``node.meta["custom"][key]``, creating the dict if needed.

    The dict is copied before writing, because exir shares one ``custom`` dict
    between a node and the nodes it was retraced into.
    """
    custom = node.meta.get(CUSTOM)
    custom = dict(custom) if isinstance(custom, dict) else {}
    custom[key] = value
    node.meta[CUSTOM] = custom
