"""ExecuTorch's own Llama example (``executorch.examples.models.llama``, shipped in the
executorch wheel) with its KV cache, as a writeback model.

The model is ``llama_transformer.construct_transformer(ModelArgs(use_kv_cache=True,
...))``: each layer's ``KVCache`` holds ``k_cache`` and ``v_cache`` buffers
``[1, n_kv_heads, max_context_len, head_dim]`` written at ``input_pos`` by slice
assignment. It is called as ExecuTorch's ``export_llama`` calls it:
``model(tokens, {"input_pos": input_pos})`` (here with the options dict passed by
keyword, ``attn_options``), exported non-strict.

Its contender ``et-custom-ops`` is ExecuTorch's own export of the same model (same
seed, same weights) with its source transformations: the custom KV cache
(``torch.ops.llama.update_cache``) and the custom SDPA op
(``torch.ops.llama.custom_sdpa``), from ``executorch.extension.llm.custom_ops``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from writeback_core.llm_runner import runner_metadata
from writeback_core.types import ModelCase

from writeback_decoders.logits import ALL_LOGITS_NOTE
from writeback_decoders.steps import GreedyTokens, cache_positions, seeded

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["ETLlamaConfig", "et_llama_case"]


@dataclass(frozen=True)
class ETLlamaConfig:
    """Sizes of the ExecuTorch Llama example (fp32, batch 1).

    ``head_dim`` is set apart from ``dim`` (``ModelArgs.head_dim``), so a large
    cache needs few positions: the example keeps a ``[max_seq, max_seq]`` causal
    mask per layer, which would outgrow the cache at long contexts.
    """

    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 128
    vocab: int = 128
    max_seq: int = 32
    seed: int = 0
    #: The name the model is offered under, and the first words of its description.
    name: str = "et-llama"
    title: str = "ExecuTorch's Llama example"
    #: ``ModelArgs.layer_types`` of a hybrid (``"conv"``: LFM2's short convolution,
    #: ``"linear_attention"``: Qwen3.5's gated DeltaNet, else attention); empty: every layer attends.
    layer_types: tuple[str, ...] = ()
    #: Further ``ModelArgs`` fields, as (name, value) pairs.
    extra_args: tuple[tuple[str, Any], ...] = ()
    #: Every position's logits (``ModelArgs.generate_full_logits``, ``[1, n, vocab]``); by default
    #: the last position's only (``[1, vocab]``), as ExecuTorch's own export returns them.
    all_logits: bool = False

    @classmethod
    def for_cache_mib(cls, cache_mib: float, seed: int = 0) -> ETLlamaConfig:
        """A 4-layer config (16 heads of 128) whose K+V caches hold ``cache_mib`` MiB together
        (64 KiB per position: 512 positions at 32 MiB)."""
        layers, kv_heads, head_dim = 4, 16, 128
        max_seq = cache_positions(cache_mib, layers, kv_heads, head_dim)
        return cls(
            dim=128,
            layers=layers,
            heads=16,
            kv_heads=kv_heads,
            head_dim=head_dim,
            hidden=256,
            vocab=256,
            max_seq=max_seq,
            seed=seed,
        )

    def sized(self, cache_mib: float) -> ETLlamaConfig:
        """This model (name, layer kinds repeated to 4 layers, further arguments kept) with 16
        heads of 128 and as many positions as make its attention layers' K+V caches hold
        ``cache_mib`` MiB together."""
        kinds = tuple(self.layer_types[i % len(self.layer_types)] for i in range(4)) if self.layer_types else ()
        attending = sum(1 for kind in kinds if kind not in _STATE_LAYERS) if kinds else 4
        sized = self.for_cache_mib(cache_mib * 4 / max(attending, 1), self.seed)
        return replace(
            sized,
            name=self.name,
            title=self.title,
            layer_types=kinds,
            extra_args=self.extra_args,
            all_logits=self.all_logits,
        )

    @property
    def attention_layers(self) -> int:
        """How many layers attend (hold a K and V cache)."""
        return sum(1 for i in range(self.layers) if self.layer_kind(i) not in _STATE_LAYERS)

    def layer_kind(self, layer: int) -> str:
        """``layer``'s entry of :attr:`layer_types` (``"full_attention"`` where none is given)."""
        return self.layer_types[layer] if self.layer_types else "full_attention"

    @property
    def cache_nbytes(self) -> int:
        """Bytes of every attention layer's K and V cache together."""
        return self.attention_layers * 2 * self.kv_heads * self.max_seq * self.head_dim * 4


#: Layer kinds of ExecuTorch's hybrids that carry a state rewritten whole instead of a K/V cache.
_STATE_LAYERS = frozenset({"conv", "linear_attention"})


def _model_args(cfg: ETLlamaConfig, dynamic: bool = False) -> Any:
    """The example's arguments; ``dynamic``: ExecuTorch's ``enable_dynamic_shape`` (the cache
    written by ``index_copy_`` at ``arange(n) + start``, the mask narrowed to ``n`` rows), as
    ``export_llama --enable_dynamic_shape`` builds it."""
    from executorch.examples.models.llama.model_args import ModelArgs

    return ModelArgs(
        dim=cfg.dim,
        n_layers=cfg.layers,
        n_heads=cfg.heads,
        n_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_dim=cfg.hidden,
        vocab_size=cfg.vocab,
        max_batch_size=1,
        max_seq_len=cfg.max_seq,
        max_context_len=cfg.max_seq,
        use_kv_cache=True,
        enable_dynamic_shape=dynamic,
        generate_full_logits=cfg.all_logits,
        layer_types=list(cfg.layer_types) or None,
        **dict(cfg.extra_args),
    )


_CHECK_IS_SIZE = "_check_is_size will be removed"


def _quiet_forward(module: nn.Module) -> nn.Module:
    """``module`` with its ``forward`` silent about ``torch._check_is_size``'s deprecation: the
    example's dynamic-shape path checks its start position with it at every call (torch 2.13
    deprecates it); nothing a user of the example can act on. The module, its parameters and
    buffers are unchanged."""
    forward = module.forward

    @functools.wraps(forward)  # the signature torch.export matches dynamic shapes against
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_CHECK_IS_SIZE, category=FutureWarning)
            return forward(*args, **kwargs)

    module.forward = quiet  # an instance's forward, so state names stay the model's
    return module


def _build(cfg: ETLlamaConfig, dynamic: bool = False) -> nn.Module:
    from executorch.examples.models.llama.llama_transformer import construct_transformer

    module: nn.Module = seeded(cfg.seed, lambda: construct_transformer(_model_args(cfg, dynamic)))
    return _quiet_forward(module) if dynamic else module


def _inputs(token: int | list[int], position: int) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    tokens = [token] if isinstance(token, int) else token
    return (torch.tensor([tokens], dtype=torch.int64),), {
        "attn_options": {"input_pos": torch.tensor([position], dtype=torch.int64)}
    }


def _prefill_export(module: nn.Module, max_seq: int, name: str, canonical: bool = False) -> ExportedProgram:
    """``module`` exported as ``export_llama --enable_dynamic_shape`` does: the token dimension
    dynamic, 1 to ``max_seq`` tokens, from a two-token example; ``input_pos`` one start
    position. ``canonical``: then its canonical passes run (:func:`_canonical`)."""
    from writeback_core.exporting import export_model

    tokens = torch.export.Dim("tokens", min=1, max=max_seq)
    args, kwargs = _inputs([1, 1], 0)
    shapes = ({1: tokens}, {"input_pos": {0: torch.export.Dim.STATIC}})
    program = export_model(module, args, kwargs, strict=False, dynamic_shapes=shapes, name=f"model {name!r}")
    return _canonical(program, args, kwargs, shapes) if canonical else program


def _canonical(program: ExportedProgram, args: Any, kwargs: Any, shapes: Any = None) -> ExportedProgram:
    """``program`` after the graph passes ExecuTorch's LLM export (``LLMEdgeManager``) runs on every
    export before lowering, re-exported as it re-exports: ``RemoveRedundantTransposes``, which
    cancels the transpose pair the custom KV cache puts around each whole cache (its storage is
    ``[B, S, H, D]``, its callers read ``[B, H, S, D]``)."""
    from executorch.extension.llm.export.export_passes import RemoveRedundantTransposes

    result = RemoveRedundantTransposes()(program.module())
    assert result is not None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CHECK_IS_SIZE, category=FutureWarning)
        return torch.export.export(result.graph_module, args, kwargs, strict=False, dynamic_shapes=shapes)


def _call(module: nn.Module, token: int, position: int) -> torch.Tensor:
    args, kwargs = _inputs(token, position)
    logits: torch.Tensor = module(*args, **kwargs)
    return logits


def _custom_ops_module(cfg: ETLlamaConfig, dynamic: bool = False) -> nn.Module:
    """The same model (same weights) with ExecuTorch's custom KV cache and SDPA source
    transformations."""
    from executorch.examples.models.llama.source_transformation.custom_kv_cache import (
        replace_kv_cache_with_custom_kv_cache,
    )
    from executorch.examples.models.llama.source_transformation.sdpa import replace_sdpa_with_custom_op

    module: nn.Module = replace_sdpa_with_custom_op(replace_kv_cache_with_custom_kv_cache(_build(cfg, dynamic)))
    return _quiet_forward(module)


def _custom_ops_program(cfg: ETLlamaConfig) -> ExportedProgram:
    """ExecuTorch's custom KV-cache and SDPA export of the same model (same weights), with the
    canonical passes of ExecuTorch's LLM export."""
    from writeback_core.exporting import export_model

    module = _custom_ops_module(cfg)
    args, kwargs = _inputs(1, 0)
    with warnings.catch_warnings():
        # The custom ops check their start position with torch._check_is_size, which torch 2.13
        # deprecates; nothing a user of the example can act on.
        warnings.filterwarnings("ignore", message=_CHECK_IS_SIZE, category=FutureWarning)
        program = export_model(module, args, kwargs, strict=False)
    return _canonical(program, args, kwargs)


def _kinds(cfg: ETLlamaConfig) -> str:
    """`` ("conv, full_attention")`` for a hybrid, nothing where every layer attends."""
    return f" ({', '.join(cfg.layer_kind(i) for i in range(cfg.layers))})" if cfg.layer_types else ""


def et_llama_case(cache_mib: float | None = None, config: ETLlamaConfig | None = None) -> ModelCase:
    """ExecuTorch's Llama example as a :class:`~writeback_core.types.ModelCase`.

    :param cache_mib: size the K+V cache to this many MiB (a 4-layer model, see
        :meth:`ETLlamaConfig.for_cache_mib`); ``None``: ``config``, or the tiny default
        (2 layers, dim 64, 32 positions).
    :param config: the sizes, when ``cache_mib`` is not given.

    Weights are random, drawn from a fixed seed inside ``build`` (two builds are
    identical; nothing is downloaded). Step ``s`` feeds one token at position
    ``s % max_seq``: token 1 first, then the greedy token eager PyTorch produced at
    the step before (:class:`~writeback_decoders.steps.GreedyTokens`, computed once
    and cached in the case). The call is ``model(tokens, attn_options={"input_pos":
    pos})``; the program's inputs are ``tokens`` and ``input_pos``; it returns the
    logits ``[1, vocab]`` (the last position's; its ``all_logits`` form, every position's
    ``[1, n, vocab]``).

    Its ``dynamic_prefill`` is the model ExecuTorch's ``export_llama --enable_dynamic_shape``
    exports: ``n`` tokens from ``input_pos`` in one call (1 to ``max_seq``), logits of the
    last; its contender ``et-custom-ops`` is the same with ExecuTorch's custom ops.
    """
    if cache_mib is not None:
        config = (config or ETLlamaConfig()).sized(cache_mib)
    cfg = config or ETLlamaConfig()
    greedy = GreedyTokens(lambda: _build(cfg), _call, cfg.max_seq)

    def step_inputs(step: int) -> tuple[torch.Tensor, ...]:
        return _inputs(greedy.token(step), greedy.position(step))[0]

    def step_kwargs(step: int) -> dict[str, Any]:
        return _inputs(greedy.token(step), greedy.position(step))[1]

    every = f"; {ALL_LOGITS_NOTE}" if cfg.all_logits else ""
    case = ModelCase(
        name=cfg.name,
        description=(
            f"{cfg.title}, {cfg.layers} layers{_kinds(cfg)}, dim {cfg.dim}, KV cache "
            f"{cfg.max_seq} positions ({cfg.cache_nbytes / (1 << 20):.3g} MiB K+V) in buffers, "
            f"seeded random weights, greedy tokens{every}"
        ),
        build=lambda: _build(cfg),
        step_inputs=step_inputs,
        step_kwargs=step_kwargs,
        observe=lambda step, outputs: greedy.observe(step, outputs[0]),
        strict=False,
        contenders={"et-custom-ops": lambda: _custom_ops_program(cfg)},
        # The example has no tokenizer: the runner takes BOS and the vocabulary from the
        # tokenizer it is given; no EOS is known.
        constant_methods=runner_metadata(
            max_seq_len=1, max_context_len=cfg.max_seq, vocab_size=cfg.vocab, bos_id=1, eos_ids=(), dynamic_shape=False
        ),
    )

    def every_position() -> ModelCase:
        return et_llama_case(config=replace(cfg, all_logits=True))

    if not cfg.all_logits:
        case = replace(case, all_logits=every_position)

    def dynamic_prefill() -> ModelCase:
        return replace(
            case,
            description=(
                f"{case.description}; token dimension dynamic up to {cfg.max_seq} (prompt prefilled in one call)"
            ),
            build=lambda: _build(cfg, dynamic=True),
            exported=lambda: _prefill_export(_build(cfg, dynamic=True), cfg.max_seq, cfg.name),
            contenders={
                "et-custom-ops": lambda: _prefill_export(
                    _custom_ops_module(cfg, dynamic=True), cfg.max_seq, cfg.name, canonical=True
                )
            },
            constant_methods=runner_metadata(
                max_seq_len=cfg.max_seq,
                max_context_len=cfg.max_seq,
                vocab_size=cfg.vocab,
                bos_id=1,
                eos_ids=(),
                dynamic_shape=True,
            ),
            dynamic_prefill=None,
            all_logits=None if cfg.all_logits else lambda: _dynamic(every_position()),
        )

    return replace(case, dynamic_prefill=dynamic_prefill)


def _dynamic(case: ModelCase) -> ModelCase:
    """``case``'s dynamic-prefill form (every case :func:`et_llama_case` makes has one)."""
    assert case.dynamic_prefill is not None, "et_llama_case gives every case a dynamic form"
    return case.dynamic_prefill()
