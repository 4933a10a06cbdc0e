"""Declare copy-back values as ``BUFFER_MUTATION`` s, so ``to_edge``/``to_executorch`` apply them."""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from typing import Any

from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument
from writeback_core import meta

from writeback_trt_copyback._program import output_values, rebuild
from writeback_trt_copyback.lift import COPY_BACK_RECORDS

__all__ = ["UninitializedCopyBackWarning", "declare_copy_back", "uninitialized_message"]


class UninitializedCopyBackWarning(UserWarning):
    """Copy-back buffers whose initial value is read will not be serialized by ExecuTorch."""


def uninitialized_message(buffers: dict[str, str]) -> str:
    """The warning naming ``buffers`` (name -> placeholder): the rule, the remedy, its caveat."""
    names = ", ".join(repr(b) for b in sorted(buffers))
    patterns = ", ".join(repr(buffers[b]) for b in sorted(buffers))
    return (
        f"copy-back buffers {names} are read before they are written. They are declared "
        "mutated, so ExecuTorch serializes only their shape and dtype, not their value, unless "
        "a pass marks their placeholder meta['et_init_buffer'] (ExecuTorch's "
        "InitializedMutableBufferPass, e.g. ExecutorchBackendConfig(passes=["
        f"InitializedMutableBufferPass([{patterns}])]), which matches placeholder names); without "
        "that, such a buffer starts from whatever its allocation held. Caveat: that pass has "
        "the buffer serialized by reading its storage host-side, which works while the buffer "
        "is on the CPU and crashes the export (it does not raise) when the buffer is on a GPU: "
        "move the model to the CPU before exporting"
    )


def _split(
    outputs: list[Any], specs: list[OutputSpec], model_outputs: int
) -> tuple[list[tuple[Any, OutputSpec]], list[tuple[Any, OutputSpec]]]:
    """``(kept, run)``: the run is every user output past the model's own ``model_outputs``.

    Lift appends copy-back values after the model's outputs, so the model's
    outputs are never part of the run, whatever their names.
    """
    kept: list[tuple[Any, OutputSpec]] = []
    run: list[tuple[Any, OutputSpec]] = []
    seen = 0
    for value, spec in zip(outputs, specs, strict=True):
        if spec.kind is OutputKind.USER_OUTPUT:
            seen += 1
            if seen > model_outputs:
                run.append((value, spec))
                continue
        kept.append((value, spec))
    return kept, run


def declare_copy_back(program: ExportedProgram) -> ExportedProgram:
    """Turn the copy-back values ``lift_mutated_buffers`` appended into ``BUFFER_MUTATION`` s.

    Algorithm:
      1. Read the records lift left in ``graph_module.meta``; a program with no
         pending record is returned as it is (a second run changes nothing).
      2. Detach the run of copy-back values: every user output past the model's
         own (lift recorded their pytree), so a model output is never taken.
      3. Pair each run value with its buffer **by name** (the record's value
         node), never by position, and declare it ``BUFFER_MUTATION`` — unless
         the buffer already has one (someone declared it), which is skipped
         rather than declared twice; such a buffer's value may be missing from
         the run (whoever declared it took it).
      4. Put mutations ahead of user outputs (the verifier's order), restore the
         model's output pytree, mark every record declared.
      5. Warn (:class:`UninitializedCopyBackWarning`) naming newly declared
         buffers that are read before written.

    Refuses (``ValueError``, nothing changed) a run holding a value no record
    names, or missing the value of a buffer nobody declared: the program was
    edited after lift, and guessing would pair a value with the wrong buffer.
    """
    record = program.graph_module.meta.get(COPY_BACK_RECORDS)
    pending = [r for r in (record or {}).get("records", []) if r["state"] == "pending"]
    if record is None or not pending:
        return program
    module = copy.deepcopy(program.graph_module)
    specs = list(program.graph_signature.output_specs)
    kept, run = _split(output_values(module), specs, record["out_spec"].num_leaves)
    declared = {s.target for s in specs if s.kind is OutputKind.BUFFER_MUTATION}
    in_run = Counter(s.arg.name for _, s in run)
    wanted = Counter(r["value"] for r in pending if r["buffer"] not in declared)
    strays = sorted((in_run - Counter(r["value"] for r in pending)).elements())
    missing = sorted((wanted - in_run).elements())
    if strays or missing:
        raise ValueError(
            f"the copy-back outputs {sorted(in_run.elements())} do not match what lift recorded "
            f"({[(r['buffer'], r['value']) for r in pending]}): unrecorded {strays}, missing "
            f"{missing}. Was the program edited after lift_mutated_buffers? Lift the exported "
            "program again"
        )
    by_name = {n.name: n for n in module.graph.nodes}
    mutations: list[tuple[Any, OutputSpec]] = []
    for r in pending:
        if r["buffer"] in declared:
            continue
        spec = OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(r["value"]), r["buffer"])
        mutations.append((by_name[r["value"]], spec))
        declared.add(r["buffer"])
    first_user = next((i for i, (_, s) in enumerate(kept) if s.kind is OutputKind.USER_OUTPUT), len(kept))
    merged = kept[:first_user] + mutations + kept[first_user:]
    records = [dict(r, state="declared") for r in record["records"]]
    result = rebuild(
        program,
        module,
        [o for o, _ in merged],
        [s for _, s in merged],
        out_spec=record["out_spec"],
        meta={COPY_BACK_RECORDS: {**record, "records": records}},
    )
    _warn_uninitialized(result, {t for _, s in mutations if (t := s.target) is not None})
    return result


def _warn_uninitialized(program: ExportedProgram, targets: set[str]) -> None:
    buffers: dict[str, str] = {}
    for node in program.graph_module.graph.nodes:
        cls = meta.get_custom(node, meta.COPY_BACK_CLASS) if node.op == "placeholder" else None
        if isinstance(cls, dict) and cls.get("buffer") in targets and cls.get("read_before_write"):
            buffers[str(cls["buffer"])] = node.name
    if buffers:
        warnings.warn(uninitialized_message(buffers), UninitializedCopyBackWarning, stacklevel=3)
