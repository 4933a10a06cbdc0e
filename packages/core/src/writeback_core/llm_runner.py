"""What ExecuTorch's LLM runner (``TextLLMRunner``, ``llama_main``, the demo apps) needs of a ``.pte``.

The runner calls ``forward(tokens, positions)`` and reads the model's metadata from
constant methods of the program (exir's ``constant_methods``). A program that breaks
this contract is refused by the runner at load ("Required metadata method
get_max_seq_len not found"), fails at the first call, or -- with more than one output
-- aborts the whole process. :func:`check_runner_contract` finds every such problem
before a ``.pte`` meant for the runner is written, and names each.

The contract, as the runner reads it:

1. ``forward`` takes exactly two user inputs: the tokens, ``int64 [1, n]``, then the
   positions, ``int64`` of one dimension: ``[1]`` (the first position of the call) or
   ``[n]`` (one per token; the runner fills ``start .. start + n``).
2. ``forward`` returns exactly one tensor, the logits: ``[1, n, V]`` or ``[1, V]``.
3. ``get_max_seq_len`` (the most tokens one call takes) is present;
   ``get_max_context_len`` (the cache's positions) is not below it.
4. ``enable_dynamic_shape`` is true only on a program whose token dimension is
   dynamic (the runner then prefills a whole prompt in one call, so that dimension
   must reach ``get_max_seq_len``); a program with a static token dimension takes one
   token per call (``n == 1``) and is prefilled token by token.
5. ``get_vocab_size`` matches the logits' last dimension; ``get_bos_id`` is an int;
   ``get_eos_ids`` a list of ints; ``use_kv_cache`` true (two inputs mean a cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

__all__ = [
    "RUNNER_METADATA",
    "RunnerContractError",
    "check_runner_contract",
    "data_file_beside",
    "load_runner_kernels",
    "logits_rows",
    "runner_contract_problems",
    "runner_metadata",
]

# The constant methods ExecuTorch's LLM runner reads, in the order it documents them.
RUNNER_METADATA = (
    "get_max_seq_len",
    "get_max_context_len",
    "use_kv_cache",
    "enable_dynamic_shape",
    "get_eos_ids",
    "get_bos_id",
    "get_vocab_size",
)


def load_runner_kernels() -> bool:
    """Register the kernels ExecuTorch's LLM runners link beside the stock ones
    (``llama::update_cache``, ``llama::custom_sdpa``, ...: ``llama_main`` and the demo apps
    are built with them, and with the quantized kernels an 8-bit embedding's
    ``quantized_decomposed::embedding_byte`` runs on) in this process, as the Python
    ``TextLLMRunner`` needs them loaded. Returns False when this executorch wheel does not
    ship the llama kernels."""
    import importlib

    importlib.import_module("executorch.kernels.quantized")  # logs, never raises, when absent
    try:
        importlib.import_module("executorch.extension.llm.custom_ops.custom_ops")
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def data_file_beside(pte: Path) -> Path | None:
    """The weights' data file of ``pte`` when it was exported with its weights apart
    (``writeback export --separate-weights``): the same path with the suffix ``.ptd``,
    which the runner loads beside the program (``TextLLMRunner(PTE, TOKENIZER, PTD)``).
    None when there is no such file."""
    data = pte.with_suffix(".ptd")
    return data if data != pte and data.is_file() else None


class RunnerContractError(ValueError):
    """A program ExecuTorch's LLM runner would refuse, fail on or abort with: every problem named."""


def runner_metadata(
    *,
    max_seq_len: int,
    max_context_len: int,
    vocab_size: int,
    bos_id: int,
    eos_ids: Sequence[int],
    dynamic_shape: bool,
) -> dict[str, Any]:
    """The runner's metadata as exir ``constant_methods`` (``use_kv_cache`` is always true:
    writeback's decoders keep their cache as state)."""
    return {
        "get_max_seq_len": int(max_seq_len),
        "get_max_context_len": int(max_context_len),
        "use_kv_cache": True,
        "enable_dynamic_shape": bool(dynamic_shape),
        "get_eos_ids": [int(e) for e in eos_ids],
        "get_bos_id": int(bos_id),
        "get_vocab_size": int(vocab_size),
    }


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _metadata_problems(methods: Mapping[str, Any]) -> list[str]:
    problems = []
    for name in ("get_max_seq_len", "get_max_context_len", "get_vocab_size"):
        value = methods.get(name)
        if name in methods and not (_int(value) and value > 0):
            problems.append(f"{name} must be a positive int, got {value!r}")
    if "get_max_seq_len" not in methods:
        problems.append("constant method get_max_seq_len is missing: the runner refuses a program without it")
    for name in ("use_kv_cache", "enable_dynamic_shape"):
        if name in methods and not isinstance(methods[name], bool):
            problems.append(f"{name} must be a bool, got {methods[name]!r}")
    if "get_bos_id" in methods and not _int(methods["get_bos_id"]):
        problems.append(f"get_bos_id must be an int, got {methods['get_bos_id']!r}")
    eos = methods.get("get_eos_ids", [])
    if not (isinstance(eos, (list, tuple)) and all(_int(e) for e in eos)):
        problems.append(f"get_eos_ids must be a list of ints, got {eos!r}")
    seq, context = methods.get("get_max_seq_len"), methods.get("get_max_context_len")
    if _int(seq) and _int(context) and context < seq:
        problems.append(f"get_max_context_len ({context}) is below get_max_seq_len ({seq})")
    if methods.get("use_kv_cache") is False:
        problems.append("use_kv_cache is false, but a program with a positions input keeps a cache")
    return problems


def _user_values(program: ExportedProgram) -> tuple[list[Any], list[Any]]:
    """The ``val`` of each user input placeholder and each user output, in order."""
    signature = program.graph_signature
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = [
        placeholders[spec.arg.name].meta.get("val")
        for spec in signature.input_specs
        if spec.kind is InputKind.USER_INPUT and hasattr(spec.arg, "name") and spec.arg.name in placeholders
    ]
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    results = output_node.args[0]
    outputs = [
        value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        for spec, value in zip(signature.output_specs, results, strict=False)
        if spec.kind is OutputKind.USER_OUTPUT
    ]
    return inputs, outputs


def _static(size: object) -> int | None:
    return size if isinstance(size, int) else None


def runner_contract_problems(program: ExportedProgram, methods: Mapping[str, Any]) -> list[str]:
    """Every way ``program`` (its ``forward``) with constant methods ``methods`` breaks the
    runner's contract (the module docstring's list); empty when it keeps it."""
    problems = _metadata_problems(methods)
    inputs, outputs = _user_values(program)
    if len(inputs) != 2:
        problems.append(
            f"forward takes {len(inputs)} inputs; the runner passes exactly two (tokens [1, n] int64, positions)"
            " -- a state passed by the caller cannot be a runner input: keep it as a module buffer"
        )
    dynamic_tokens = False
    if inputs:
        tokens = inputs[0]
        if not (isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int64 and tokens.dim() == 2):
            problems.append(f"input 0 (tokens) must be int64 [1, n], got {_describe(tokens)}")
        else:
            if _static(tokens.shape[0]) != 1:
                problems.append(f"input 0 (tokens) must have batch 1, got {_describe(tokens)}")
            width = _static(tokens.shape[1])
            dynamic_tokens = width is None
            if width is not None and width != 1:
                problems.append(
                    f"input 0 (tokens) has a static token dimension of {width}: the runner calls with 1 token at a "
                    "time unless the dimension is dynamic"
                )
    if len(inputs) >= 2:
        positions = inputs[1]
        if not (isinstance(positions, torch.Tensor) and positions.dtype == torch.int64 and positions.dim() == 1):
            problems.append(f"input 1 (positions) must be int64 of one dimension, got {_describe(positions)}")
    if len(outputs) != 1:
        problems.append(
            f"forward returns {len(outputs)} outputs; the runner takes exactly one (the logits) and aborts the "
            "process on more"
        )
    if outputs:
        logits = outputs[0]
        if not (isinstance(logits, torch.Tensor) and logits.dim() in (2, 3) and logits.is_floating_point()):
            problems.append(f"output 0 (logits) must be floating [1, n, V] or [1, V], got {_describe(logits)}")
        else:
            vocab = methods.get("get_vocab_size")
            last = _static(logits.shape[-1])
            if _int(vocab) and last is not None and last != vocab:
                problems.append(f"get_vocab_size is {vocab} but the logits' last dimension is {last}")
    dynamic = methods.get("enable_dynamic_shape", False)
    if dynamic is True and not dynamic_tokens:
        problems.append(
            "enable_dynamic_shape is true but the token dimension is static: the runner would prefill the whole "
            "prompt in one call the program cannot take; export with a dynamic token dimension or set it false"
        )
    if dynamic is False and dynamic_tokens:
        problems.append(
            "the token dimension is dynamic but enable_dynamic_shape is false: set it true so the runner "
            "prefills the prompt in one call"
        )
    return problems


def logits_rows(program: ExportedProgram) -> str | None:
    """Which positions of a call ``program`` returns logits for, read from its output's shape:
    ``"last"`` (``[1, V]``, or ``[1, 1, V]`` from a call of a dynamic number of tokens: what the
    runner reads, the LM head run on one row), ``"every"`` (``[1, n, V]`` with ``n`` the call's
    tokens), ``"one"`` (the call takes one token: its one position); ``None`` when the program
    has not one floating output of rank 2 or 3."""
    inputs, outputs = _user_values(program)
    if len(outputs) != 1:
        return None
    logits = outputs[0]
    if not (isinstance(logits, torch.Tensor) and logits.dim() in (2, 3) and logits.is_floating_point()):
        return None
    if logits.dim() == 2:
        return "last"
    tokens = inputs[0] if inputs else None
    dynamic = isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and _static(tokens.shape[1]) is None
    if _static(logits.shape[1]) == 1:
        return "last" if dynamic else "one"
    return "every"


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    return type(value).__name__


def check_runner_contract(program: ExportedProgram, methods: Mapping[str, Any]) -> None:
    """Raise :class:`RunnerContractError` naming every problem :func:`runner_contract_problems` finds."""
    problems = runner_contract_problems(program, methods)
    if problems:
        listed = "\n".join(f"- {p}" for p in problems)
        raise RunnerContractError(f"this program does not fit ExecuTorch's LLM runner:\n{listed}")
