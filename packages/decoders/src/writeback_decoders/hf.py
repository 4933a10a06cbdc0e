"""Hugging Face causal LMs with a ``StaticCache``, exported as transformers' own ExecuTorch
integration exports them (needs the ``hf`` extra: ``pip install 'writeback-decoders[hf]'``).

The module is ``transformers.integrations.executorch.TorchExportableModuleWithStaticCache``
around the model: the cache's tensors are registered buffers (``key_cache_i``,
``value_cache_i``, ``cumulative_length_i``), its ``forward(input_ids=None,
inputs_embeds=None, cache_position=None)`` takes keyword arguments, and it is
exported with ``strict=True``, as ``convert_and_export_with_cache`` and
``TorchExportableModuleForDecoderOnlyLM.export`` do (non-strict export of it leaves
the cache as lifted constants and no buffer mutation).

transformers is imported only when a model is built or :func:`hf_case` is
called, so this package imports, and offers its other models, without it.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from writeback_core.llm_runner import runner_metadata
from writeback_core.types import ModelCase

from writeback_decoders.logits import ALL_LOGITS_NOTE, causal_lm_logits, keeps_logits
from writeback_decoders.quantize import QUANTIZATIONS, quantize, scheme
from writeback_decoders.steps import GreedyTokens, cache_positions, seeded

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "HF_ARCHITECTURES",
    "HFArchitecture",
    "TransformersMissingError",
    "config_of",
    "hf_available",
    "hf_case",
    "hf_config",
    "hf_model_case",
    "require_transformers",
    "runner_metadata_of",
]

INSTALL_HINT = "pip install 'writeback-decoders[hf]'"


class TransformersMissingError(ModuleNotFoundError):
    """transformers is not installed: the Hugging Face models need the ``hf`` extra."""


def hf_available() -> bool:
    """Whether transformers can be imported (checked without importing it)."""
    return importlib.util.find_spec("transformers") is not None


def require_transformers(what: str) -> Any:
    """The ``transformers`` module, imported.

    :raises TransformersMissingError: it is not installed; the message names ``what``
        needed it and how to install the ``hf`` extra.
    """
    try:
        import transformers
    except ImportError as error:
        raise TransformersMissingError(
            f"{what} needs transformers, which is not installed: {INSTALL_HINT} "
            f"(the 'hf' extra; transformers>=5.23,<6). ExecuTorch's Llama example (et-llama) runs without it."
        ) from error
    return transformers


@dataclass(frozen=True)
class HFArchitecture:
    """One Hugging Face architecture: its config class and the extra settings of its tiny
    and sized configs (beyond the shared sizes)."""

    name: str
    config_class: str
    extra: tuple[tuple[str, Any], ...] = ()

    def config(self, **sizes: Any) -> Any:
        """``config_class(**sizes, **extra)``; imports transformers."""
        transformers = require_transformers(f"the {self.name} architecture")
        return getattr(transformers, self.config_class)(**sizes, **dict(self.extra))


# Gemma 3 alternates sliding-window and global layers: the tiny config has one of
# each (the integration's static cache keeps every position of both).
HF_ARCHITECTURES: dict[str, HFArchitecture] = {
    a.name: a
    for a in (
        HFArchitecture("llama", "LlamaConfig"),
        HFArchitecture("qwen3", "Qwen3Config"),
        HFArchitecture("gemma", "Gemma3TextConfig", (("query_pre_attn_scalar", 16),)),
    )
}


def _sizes(architecture: str, cache_mib: float | None) -> dict[str, Any]:
    """The config keywords of :func:`hf_config` (worked out without transformers)."""
    if architecture not in HF_ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {', '.join(sorted(HF_ARCHITECTURES))}")
    if cache_mib is None:
        layers, heads, kv_heads, head_dim, hidden, vocab, max_seq = 2, 4, 2, 16, 64, 128, 32
    else:
        layers, heads, kv_heads, head_dim, hidden, vocab = 4, 16, 16, 128, 128, 256
        max_seq = cache_positions(cache_mib, layers, kv_heads, head_dim)
    sizes: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_seq,
    }
    if architecture == "gemma":
        sizes["sliding_window"] = max(1, max_seq // 2)
        sizes["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    return sizes


def hf_config(architecture: str, cache_mib: float | None = None) -> Any:
    """A config of ``architecture`` (``HF_ARCHITECTURES``), tiny or sized to ``cache_mib``.

    Tiny: 2 layers, hidden 64, 4 heads of 16 (2 KV heads), 32 cache positions.
    Sized: 4 layers, hidden 128, 16 heads of 128, as many positions as make a K+V
    cache of ``cache_mib`` MiB (64 KiB per position: 512 at 32 MiB). The cache
    length is the config's ``max_position_embeddings``.
    """
    return HF_ARCHITECTURES[architecture].config(**_sizes(architecture, cache_mib))


# How a mixture-of-experts layer runs its experts (transformers' experts implementations; a model
# without one ignores it). Its default on CPU, "grouped_mm", counts each expert's tokens with
# torch.histc, an op outside Core ATen that no ExecuTorch program can hold; its "eager" loops over
# the experts a call hits, a data-dependent loop torch.export cannot trace. "batched_mm" gathers
# each token's experts' weights and multiplies them: static shapes, Core ATen ops, the same sums.
_EXPERTS = "batched_mm"


def _load(source: Any, seed: int, dtype: torch.dtype) -> nn.Module:
    """The causal LM: from a local folder (safetensors weights, no remote code) or a config,
    its experts (if it has any) run by ``batched_mm`` (:data:`_EXPERTS`)."""
    transformers = require_transformers("a Hugging Face model")
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"no model folder {str(folder)!r}: hf_case takes a local folder holding config.json and "
                "*.safetensors (nothing is downloaded), or a transformers config"
            )
        # Nothing read from the folder may become code: no remote code, no pickled weights.
        model: nn.Module = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            experts_implementation=_EXPERTS,
        )
        return model
    auto = transformers.AutoModelForCausalLM
    built: nn.Module = seeded(seed, lambda: auto.from_config(source, dtype=dtype, experts_implementation=_EXPERTS))
    return built


def _static_generation(model: Any, max_cache_len: int) -> Any:
    """``model`` set up for a static cache of ``max_cache_len`` positions, batch 1, as the
    integration requires (``generation_config.cache_implementation == "static"``)."""
    from transformers import GenerationConfig

    model.config.use_cache = True
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        use_cache=True,
        cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": max_cache_len},
    )
    return model


@functools.cache
def _static_module() -> Callable[[Any, bool], nn.Module]:
    """transformers' ``TorchExportableModuleWithStaticCache`` with one change: its ``forward``
    returns the last position's logits unless built with ``all_logits``
    (:mod:`writeback_decoders.logits`); the cache, its buffers and the inputs are the integration's."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    class StaticCacheModule(TorchExportableModuleWithStaticCache):
        def __init__(self, model: Any, all_logits: bool) -> None:
            super().__init__(model)
            self.all_logits = all_logits
            self.keeps = keeps_logits(model)  # read outside the traced call

        def forward(
            self,
            input_ids: torch.Tensor | None = None,
            inputs_embeds: torch.Tensor | None = None,
            cache_position: torch.Tensor | None = None,
        ) -> torch.Tensor:
            # As the integration's forward: each layer's write position is set from the call's
            # first position, and the model reads its positions from the cache (not from
            # ``cache_position``), so a new generation from position 0 overwrites the cache.
            if cache_position is None:
                raise ValueError("cache_position is required: the position of each token in the cache")
            counters = []
            for index, layer in enumerate(self.static_cache.layers):
                written = getattr(layer, "cumulative_length", None)
                if not isinstance(written, torch.Tensor):
                    raise TypeError(
                        f"static cache layer {index} ({type(layer).__name__}) keeps no cumulative_length tensor, "
                        "so a call cannot say where it writes: this model needs writeback's states wrapper"
                    )
                counters.append(written)
            for written in counters:  # every layer checked before any is set
                written.copy_(cache_position[0])
            return causal_lm_logits(
                self.model,
                self.all_logits,
                self.keeps,
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=None,
                past_key_values=self.static_cache,
                use_cache=True,
            )

    return StaticCacheModule


def _wrap(model: Any, max_cache_len: int, all_logits: bool = False) -> nn.Module:
    """The integration's exportable module around ``model``, with a static cache of ``max_cache_len``,
    returning the last position's logits (every position's with ``all_logits``)."""
    wrapped = _static_module()(_static_generation(model, max_cache_len), all_logits)
    return wrapped.eval().requires_grad_(False)


def _kwargs(token: int, position: int) -> dict[str, Any]:
    return {
        "input_ids": torch.tensor([[token]], dtype=torch.int64),
        "cache_position": torch.tensor([position], dtype=torch.int64),
    }


def _call(module: nn.Module, token: int, position: int) -> torch.Tensor:
    logits: torch.Tensor = module(**_kwargs(token, position))
    return logits


def config_of(source: Any) -> Any:
    """The transformers config of ``source``: a model folder's (read as data), or a config given as is."""
    if isinstance(source, (str, os.PathLike)):
        transformers = require_transformers("a Hugging Face model")
        folder = Path(source)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"no model folder with a config.json at {str(folder)!r}: hf_case takes a local folder holding "
                "config.json and *.safetensors (nothing is downloaded), or a transformers config"
            )
        return transformers.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    return source


def _ids(value: Any) -> list[int]:
    """A config's token id field (an int, a list of ints or ``None``) as a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def runner_metadata_of(config: Any, max_cache_len: int, dynamic: bool = False) -> dict[str, Any]:
    """ExecuTorch's LLM-runner metadata of a causal LM with ``config`` over a static cache of
    ``max_cache_len`` positions, exported one token per call or (``dynamic``) with a dynamic
    token dimension of up to ``max_cache_len`` tokens."""
    text = config.get_text_config()
    bos = _ids(getattr(text, "bos_token_id", None))
    return runner_metadata(
        max_seq_len=max_cache_len if dynamic else 1,
        max_context_len=max_cache_len,
        vocab_size=int(text.vocab_size),
        bos_id=bos[0] if bos else 0,
        eos_ids=_ids(getattr(text, "eos_token_id", None)),
        dynamic_shape=dynamic,
    )


def _prefill_export(build: Callable[[], nn.Module], max_cache_len: int, name: str, strict: bool = True) -> Any:
    """The module exported with a dynamic token dimension of 1 to ``max_cache_len`` tokens
    (``input_ids [1, n]``, ``cache_position [n]``), from a two-token example."""
    from writeback_core.exporting import export_model

    tokens = torch.export.Dim("tokens", min=1, max=max_cache_len)
    example = {"input_ids": torch.tensor([[1, 1]], dtype=torch.int64), "cache_position": torch.arange(2)}
    shapes = {"input_ids": {1: tokens}, "cache_position": {0: tokens}}
    return export_model(build(), (), example, strict=strict, dynamic_shapes=shapes, name=f"model {name!r}")


def _static_export(build: Callable[[], nn.Module], max_cache_len: int, name: str) -> Any:
    """The static-cache module exported one token per call, as transformers' integration does."""
    from writeback_core.exporting import export_model

    return export_model(build(), (), _kwargs(1, 0), strict=True, name=f"model {name!r}")


def _dynamic(case: ModelCase) -> ModelCase:
    """``case``'s dynamic-prefill form (every case :func:`_case` makes with a dynamic form has one)."""
    assert case.dynamic_prefill is not None, "the all-logits form of a case with a dynamic form has one too"
    return case.dynamic_prefill()


# The contender a custom-ops case carries: the same weights through transformers' StaticCache.
STATIC_CONTENDER = "transformers StaticCache"


class _Deferred(Mapping[str, Any]):
    """A mapping worked out on first read (a config needs transformers, which listing the
    models must not import)."""

    def __init__(self, make: Callable[[], dict[str, Any]]) -> None:
        self._make = make
        self._made: dict[str, Any] | None = None

    def _items(self) -> dict[str, Any]:
        if self._made is None:
            self._made = self._make()
        return self._made

    def __getitem__(self, key: str) -> Any:
        return self._items()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())


def _case(
    source: Callable[[], Any],
    name: str,
    description: str,
    max_cache_len: int,
    seed: int,
    dtype: torch.dtype,
    prompt_token: int,
    integration_export: bool,
    attention: str = "static",
    quantization: str | None = None,
    all_logits: bool = False,
) -> ModelCase:
    """The case; ``source()`` gives the folder or config (called only when a model is built);
    ``quantization``: a scheme of :mod:`writeback_decoders.quantize` applied to every build;
    ``all_logits``: every call returns every position's logits, not the last one's only
    (:mod:`writeback_decoders.logits`)."""

    def model() -> Any:
        loaded = _load(source(), seed, dtype)
        if quantization is None:
            return loaded
        return quantize(loaded, quantization)

    def build() -> nn.Module:
        if attention == "custom-ops":
            from writeback_decoders.custom_ops import CustomOpsDecoder

            return CustomOpsDecoder(model(), max_cache_len, all_logits).eval().requires_grad_(False)
        if attention == "states":
            from writeback_decoders.hf_states import StatesDecoder

            return StatesDecoder(model(), max_cache_len, all_logits).eval().requires_grad_(False)
        return _wrap(model(), max_cache_len, all_logits)

    # ExecuTorch's ops take the start position as an int read from the tensor (.item()),
    # which only the non-strict export traces; the states' cache layers are Python objects.
    strict = attention == "static"

    greedy = GreedyTokens(build, _call, max_cache_len, prompt=prompt_token)
    exported: Callable[[], Any] | None = None
    if integration_export:

        def exported() -> Any:
            from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

            causal_lm = cast("PreTrainedModel", _static_generation(model(), max_cache_len))
            recipe = TorchExportableModuleForDecoderOnlyLM(causal_lm, batch_size=1, max_cache_len=max_cache_len)
            with torch.no_grad():
                return recipe.export(**_kwargs(prompt_token, 0), strict=True)

    case = ModelCase(
        name=name,
        description=description,
        build=build,
        step_inputs=lambda step: (),
        step_kwargs=lambda step: _kwargs(greedy.token(step), greedy.position(step)),
        observe=lambda step, outputs: greedy.observe(step, outputs[0]),
        strict=strict,
        exported=exported,
        constant_methods=_Deferred(lambda: runner_metadata_of(config_of(source()), max_cache_len)),
    )

    def again(name: str, description: str, quantization: str | None, all_logits: bool) -> ModelCase:
        """The same model under another name and description, quantized or returning logits otherwise."""
        return _case(
            source,
            name,
            description,
            max_cache_len,
            seed,
            dtype,
            prompt_token,
            integration_export,
            attention,
            quantization=quantization,
            all_logits=all_logits,
        )

    if quantization is None:

        def quantized(scheme_name: str) -> ModelCase:
            chosen = scheme(scheme_name, getattr(config_of(source()).get_text_config(), "hidden_size", None))
            return again(f"{name}-{scheme_name}", f"{description}; {chosen.description}", scheme_name, all_logits)

        case = replace(case, quantized=quantized, quantizations=tuple(QUANTIZATIONS))
    else:
        chosen = scheme(quantization)
        case = replace(case, rtol=chosen.rtol, atol=chosen.atol)

    def every_position() -> ModelCase:
        return again(name, f"{description}; {ALL_LOGITS_NOTE}", quantization, True)

    if not all_logits:
        case = replace(case, all_logits=every_position)

    def static_build() -> nn.Module:
        return _wrap(model(), max_cache_len, all_logits)

    if attention == "custom-ops":
        # What a user exports without these kernels: transformers' own static cache.
        case = replace(case, contenders={STATIC_CONTENDER: lambda: _static_export(static_build, max_cache_len, name)})

    def dynamic_prefill() -> ModelCase:
        contenders = {}
        if attention == "custom-ops":
            contenders = {STATIC_CONTENDER: lambda: _prefill_export(static_build, max_cache_len, name)}
        return replace(
            case,
            description=f"{description}; token dimension dynamic up to {max_cache_len} (prompt prefilled in one call)",
            exported=lambda: _prefill_export(build, max_cache_len, name, strict),
            constant_methods=_Deferred(lambda: runner_metadata_of(config_of(source()), max_cache_len, True)),
            dynamic_prefill=None,
            contenders=contenders,
            all_logits=None if all_logits else lambda: _dynamic(every_position()),
        )

    # The states' layers take another path for one token than for several (hf_states).
    return replace(case, dynamic_prefill=None if attention == "states" else dynamic_prefill)


_EXPORTED_AS = "exported as transformers' ExecuTorch integration does (strict, keyword inputs), greedy tokens"


def hf_case(
    source: str | os.PathLike[str] | Any,
    *,
    name: str | None = None,
    max_cache_len: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    prompt_token: int = 1,
    integration_export: bool = False,
    attention: str = "static",
) -> ModelCase:
    """A Hugging Face causal LM with a ``StaticCache`` as a :class:`~writeback_core.types.ModelCase`.

    :param source: a local model folder (``config.json`` and ``*.safetensors``:
        ``AutoModelForCausalLM.from_pretrained(folder)``, never downloading, never
        running code from the folder or unpickling weights), or a transformers config
        (random weights drawn from ``seed`` inside ``build``: two builds are identical).
    :param name: the case's name; default ``hf-<model_type>``.
    :param max_cache_len: cache positions; default the config's
        ``max_position_embeddings``, at most 1,024 for a folder and 256 for a config.
    :param dtype: weights and cache dtype (float32: the run compares with eager at fp32
        tolerances).
    :param prompt_token: the token fed at step 0.
    :param integration_export: hand the pipeline the program transformers' own
        ``TorchExportableModuleForDecoderOnlyLM(...).export(...)`` makes (``exported=``)
        instead of letting writeback export the same module strictly with the same
        keyword inputs.
    :param attention: ``"static"``: transformers' ``StaticCache`` and attention (the cache
        written by ``index_copy_``, the whole cache read every call); ``"custom-ops"``:
        :class:`~writeback_decoders.custom_ops.CustomOpsDecoder` (the cache written in place
        by ExecuTorch's ``llama::update_cache``, attention by ``llama::custom_sdpa`` over the
        written positions only), for configs :func:`~writeback_decoders.custom_ops.custom_ops_refusal`
        accepts.

    Step ``s`` calls ``module(input_ids=[[token]], cache_position=[s % max_cache_len])``;
    the token is ``prompt_token`` at step 0, then the greedy token eager PyTorch
    produced at the step before (:class:`~writeback_decoders.steps.GreedyTokens`,
    computed once and cached in the case). It returns the logits ``[1, 1, vocab]``: a call of
    ``n`` tokens (the ``dynamic_prefill`` form) returns its last position's, the LM head run on
    that row only; the case's ``all_logits`` form returns every position's, ``[1, n, vocab]``.

    :raises TransformersMissingError: transformers is not installed (the message says
        how to install it).
    """
    require_transformers("hf_case")
    if attention not in ("static", "custom-ops", "states"):
        raise ValueError(f"attention must be 'static', 'custom-ops' or 'states', got {attention!r}")
    config = config_of(source)
    text = config.get_text_config()
    if attention == "custom-ops":
        from writeback_decoders.custom_ops import CustomOpsUnsupported, custom_ops_refusal

        refusal = custom_ops_refusal(config)
        if refusal is not None:
            kind = getattr(text, "model_type", "model")
            raise CustomOpsUnsupported(f"this {kind} uses {refusal}; use attention='static'")
        if integration_export:
            raise ValueError("integration_export exports transformers' own static-cache module; use attention='static'")
    if attention == "states":
        from writeback_decoders.hf_states import StatesUnsupported, states_description, states_refusal

        refused = states_refusal(config)
        if refused is not None:
            raise StatesUnsupported(refused)
        if integration_export:
            raise ValueError("integration_export exports transformers' own static-cache module; use attention='static'")
    if max_cache_len is None:
        # A folder is a model to deploy (up to 1,024 positions); a config, a test or bench case.
        cap = 1024 if isinstance(source, (str, os.PathLike)) else 256
        max_cache_len = min(int(getattr(text, "max_position_embeddings", None) or cap), cap)
    if max_cache_len < 1:
        raise ValueError(f"max_cache_len must be at least 1, got {max_cache_len}")
    if attention == "states":
        refused = states_refusal(config, max_cache_len)
        if refused is not None:
            raise StatesUnsupported(refused)
    model_type = getattr(text, "model_type", "") or type(text).__name__
    where = f"from {os.fspath(source)}" if isinstance(source, (str, os.PathLike)) else "seeded random weights"
    cache = (
        f"StaticCache of {max_cache_len} positions"
        if attention == "static"
        else states_description(max_cache_len)
        if attention == "states"
        else f"cache of {max_cache_len} positions written by llama::update_cache, read by llama::custom_sdpa "
        "up to the last written position"
    )
    description = (
        f"Hugging Face {model_type}, {getattr(text, 'num_hidden_layers', '?')} layers, {cache}, {where}, "
        f"{_EXPORTED_AS if attention == 'static' else 'greedy tokens'}"
    )
    # A config the caller holds is not read again: the case keeps its own copy.
    kept = source if isinstance(source, (str, os.PathLike)) else copy.deepcopy(config)
    return _case(
        lambda: kept,
        name or f"hf-{model_type}",
        description,
        max_cache_len,
        seed,
        dtype,
        prompt_token,
        integration_export,
        attention,
    )


def hf_model_case(architecture: str, cache_mib: float | None = None) -> ModelCase:
    """The named default ``hf-<architecture>``: tiny, or sized to ``cache_mib`` (see :func:`hf_config`).

    transformers is imported only when the model is built, so the case can be offered
    (and listed) cheaply; building it without transformers raises
    :class:`TransformersMissingError`.
    """
    sizes = _sizes(architecture, cache_mib)
    max_seq = sizes["max_position_embeddings"]
    arch = HF_ARCHITECTURES[architecture]
    nbytes = sizes["num_hidden_layers"] * 2 * sizes["num_key_value_heads"] * sizes["head_dim"] * max_seq * 4
    description = (
        f"Hugging Face {arch.config_class.removesuffix('Config')}, {sizes['num_hidden_layers']} layers, "
        f"hidden {sizes['hidden_size']}, StaticCache of {max_seq} positions ({nbytes / (1 << 20):.3g} MiB K+V), "
        f"seeded random weights, {_EXPORTED_AS}"
    )
    return _case(
        lambda: hf_config(architecture, cache_mib),
        f"hf-{architecture}",
        description,
        max_seq,
        seed=0,
        dtype=torch.float32,
        prompt_token=1,
        integration_export=False,
    )
