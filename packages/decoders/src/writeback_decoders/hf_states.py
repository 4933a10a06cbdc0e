"""A Hugging Face causal LM whose per-layer state is whatever transformers' own cache layers hold.

transformers describes each layer's state by the cache layer class its ``StaticCache`` picks for
the layer's type (``get_layer_types_and_kwargs`` then ``STATIC_LAYER_TYPE_MAPPING``): a
``StaticLayer`` holds ``keys``, ``values`` and a ``cumulative_length`` counter; a
``LinearAttentionLayer`` (layer types ``conv``, ``linear_attention``, which Mamba, Mamba2, LFM2's
short convolutions and Qwen3.5's gated DeltaNet use) holds ``conv_states`` and
``recurrent_states``, one per state index; the hybrid layers of Falcon-H1 hold both. Each class
allocates its tensors on the first call and from then on writes them in place (``index_copy_``,
``copy_``, ``add_``).

:class:`StatesDecoder` takes that rule as it is, with no list of families:

1. build the model's ``StaticCache`` (a sliding-window layer whose window holds every position
   of the program made a full static layer: transformers' sliding layer picks its path and the
   mask's query offset by a Python int, which a program would hold at its traced value; a
   shorter window is refused) and run two tokens through the model, so that every layer
   allocates its tensors at their real shapes and dtypes;
2. register one zeroed buffer per tensor the layers then hold (a tensor attribute, or one entry of
   a dict of tensors), named ``layer{i}_{attribute}`` (``_{index}`` for a dict entry), and mark the
   linear-attention states as carried over (``has_previous_state``): a zero conv state is the
   zero padding of a first call, a zero recurrent state the zero initial state;
3. register one zeroed buffer per plain tensor attribute of the model's modules that the second
   call reassigned (state the model keeps outside the cache layers: RecurrentGemma's
   ``conv1d_state`` and ``recurrent_states``), named ``{module path}_{attribute}``;
4. on each call point the layers and those attributes at the buffers, run the model's own code,
   copy each reassigned attribute's new value into its buffer (``copy_``: a buffer mutation of
   the program) and point the attribute back, and check that every layer still holds its
   buffer: a layer that replaced a state instead of writing into it would lose the state in the
   exported program, so the call raises :class:`StateLostError` naming it.

The prompt is prefilled one token per call: the layer code of these models takes another path
for one token than for several (``seq_len == 1``), and only the one-token path continues from the
carried state, so a program with a dynamic token dimension could not serve both.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from writeback_decoders.logits import causal_lm_logits, keeps_logits

__all__ = [
    "AttributeSlot",
    "StateLostError",
    "StateSlot",
    "StatesDecoder",
    "StatesUnsupported",
    "states_description",
    "states_refusal",
    "uses_states",
]


class StatesUnsupported(ValueError):
    """The model keeps state somewhere transformers' cache layers do not describe, or exports what
    ExecuTorch cannot run; the message names the model type, the cause and what would fix it."""


class StateLostError(RuntimeError):
    """A cache layer replaced one of its state tensors instead of writing into it."""


@dataclass(frozen=True)
class StateSlot:
    """Where one state tensor lives: ``cache.layers[layer].<attribute>`` (``[index]`` when the
    attribute is a dict of tensors), held by the decoder as buffer ``buffer``."""

    layer: int
    attribute: str
    index: Any
    buffer: str

    def read(self, layer: Any) -> Any:
        value = getattr(layer, self.attribute)
        return value if self.index is None else value[self.index]

    def bind(self, layer: Any, tensor: torch.Tensor) -> None:
        if self.index is None:
            setattr(layer, self.attribute, tensor)
        else:
            getattr(layer, self.attribute)[self.index] = tensor


@dataclass(frozen=True)
class AttributeSlot:
    """State a model keeps as a plain tensor attribute ``name`` of its module at ``path`` (which its
    forward reassigns every call), held by the decoder as buffer ``buffer``."""

    path: str
    name: str
    buffer: str

    def read(self, model: nn.Module) -> Any:
        return getattr(model.get_submodule(self.path), self.name)

    def bind(self, model: nn.Module, tensor: torch.Tensor) -> None:
        # Into the module's __dict__: setattr would refuse a registered buffer's name, and a
        # tensor there stays a plain attribute, as the model's own code assigns it.
        vars(model.get_submodule(self.path))[self.name] = tensor


def _attribute_tensors(model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """Every plain tensor attribute of ``model``'s modules (not a parameter or buffer): (module
    path, attribute) -> the tensor."""
    return {
        (path, name): value
        for path, module in model.named_modules()
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    }


def _sliding(layer: Any) -> bool:
    from transformers.cache_utils import StaticLayer

    return bool(getattr(layer, "is_sliding", False)) and isinstance(layer, StaticLayer)


def _window_refusal(cache: Any, kind: str, max_cache_len: int) -> str | None:
    """Why a sliding-window layer of ``cache`` cannot be held for a program of ``max_cache_len``
    positions (its window is shorter), or ``None``."""
    for i, layer in enumerate(cache.layers):
        if _sliding(layer) and layer.max_cache_len < max_cache_len:
            return (
                f"model type {kind!r}: cache layer {i} is a sliding window of {layer.max_cache_len} positions, "
                f"fewer than the program's {max_cache_len}, and transformers' sliding layer counts its positions "
                "in a Python int that no exported program carries; it would export with a cache of at most "
                f"{layer.max_cache_len} positions"
            )
    return None


def _full_windows(cache: Any, kind: str, max_cache_len: int) -> None:
    """Each sliding-window layer of ``cache`` (its window holds every position of the program)
    replaced by a full one of ``max_cache_len`` positions: the same attention (the window never
    cuts a position), written at a traced position. transformers' sliding layer picks its path and
    the mask's query offset by a Python counter, which an exported program would hold at the value
    it had while tracing.

    :raises StatesUnsupported: a window is shorter than ``max_cache_len``.
    """
    from transformers.cache_utils import StaticLayer

    refusal = _window_refusal(cache, kind, max_cache_len)
    if refusal is not None:
        raise StatesUnsupported(refusal)
    for i, layer in enumerate(cache.layers):
        if _sliding(layer):
            cache.layers[i] = StaticLayer(max_cache_len=max_cache_len)


def _buffer_name(path: str, name: str) -> str:
    return f"{path.replace('.', '_')}_{name}" if path else name


# Families that cannot be exported by this route, by model type: the cause and the fix.
# Each was tried; transformers' own code decides it, not writeback.
_REFUSED: dict[str, str] = {
    "xlstm": (
        "keeps its state in its own xLSTMCache, not in transformers' cache layers (its StaticCache describes "
        "attention layers it does not have), and transformers refuses the SDPA attention implementation for "
        "it; it would export once transformers describes its state with cache layer classes, as it does for Mamba"
    ),
}


def _layer_classes(config: Any) -> list[type]:
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=1)
    return [type(layer) for layer in cache.layers]


def uses_states(config: Any) -> bool:
    """Whether a model with ``config`` has a layer whose cache is not a key/value cache (its state
    is a linear-attention, convolution or SSM state, or no cache at all), by the cache layer
    classes transformers' ``StaticCache`` picks for it. A model type :func:`states_refusal`
    refuses counts as one (so it reaches that refusal)."""
    from transformers.cache_utils import StaticLayer

    text = config.get_text_config()
    if getattr(text, "model_type", "") in _REFUSED:
        return True
    try:
        classes = _layer_classes(config)
    except Exception:  # transformers cannot describe it: states_refusal says so
        return True
    return any(not issubclass(cls, StaticLayer) or hasattr(cls, "update_conv_state") for cls in classes)


def states_refusal(config: Any, max_cache_len: int | None = None) -> str | None:
    """Why a model with ``config`` cannot be exported with its state as program buffers (with a
    cache of ``max_cache_len`` positions, when given), in one sentence naming the model type, the
    cause and what would fix it; ``None`` when it can."""
    text = config.get_text_config()
    kind = getattr(text, "model_type", "") or type(text).__name__
    if kind in _REFUSED:
        return f"model type {kind!r} {_REFUSED[kind]}"
    if max_cache_len is not None:
        from transformers import StaticCache

        return _window_refusal(StaticCache(config=config, max_cache_len=max_cache_len), kind, max_cache_len)
    try:
        _layer_classes(config)
    except Exception as error:  # whatever transformers raises, it is the cause to name
        return (
            f"model type {kind!r}: transformers' StaticCache cannot describe its layers' state "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); it would export "
            "once transformers gives its layers cache layer classes"
        )
    return None


def states_description(max_cache_len: int) -> str:
    """How :class:`StatesDecoder` keeps a model's state, for a case's description."""
    return (
        f"every state of transformers' cache layers (attention caches of {max_cache_len} positions, "
        "convolution, SSM and linear-attention states) as program buffers, prompt prefilled token by token "
        "(the model's layers take another path for several tokens)"
    )


def _cache_argument(model: nn.Module) -> str:
    """The keyword the model's ``forward`` takes its cache by (``past_key_values`` or, in the
    Mamba family, ``cache_params``)."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("past_key_values", "cache_params"):
        if name in parameters:
            return name
    raise StatesUnsupported(
        f"{type(model).__name__}.forward takes no cache (neither past_key_values nor cache_params); "
        "its state cannot be carried between calls"
    )


def _tensors(layer: Any) -> Iterator[tuple[str, Any, torch.Tensor]]:
    """Each state tensor a cache layer holds: (attribute, dict key or None, tensor)."""
    for attribute, value in sorted(vars(layer).items()):
        if isinstance(value, torch.Tensor):
            yield attribute, None, value
        elif isinstance(value, dict):
            for index, item in sorted(value.items(), key=lambda kv: str(kv[0])):
                if isinstance(item, torch.Tensor):
                    yield attribute, index, item


class StatesDecoder(nn.Module):
    """``model`` (a transformers causal LM) as ExecuTorch's runner calls it, one token per call:
    ``forward(input_ids [1, 1], cache_position [1]) -> logits [1, 1, V]`` (its one position, cut
    before the LM head unless ``all_logits``: :mod:`writeback_decoders.logits`), every tensor of its
    ``StaticCache`` layers held as a registered buffer and written there by the model's own code.

    :ivar slots: where each buffer is bound, in buffer order.
    :raises StatesUnsupported: the model keeps state that transformers' cache layers do not
        describe (:func:`states_refusal`).
    """

    def __init__(self, model: Any, max_cache_len: int, all_logits: bool = False) -> None:
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import DummyLayer

        refusal = states_refusal(model.config)
        if refusal is not None:
            raise StatesUnsupported(refusal)
        model.config.use_cache = True
        self.model = model
        self.max_cache_len = max_cache_len
        self.all_logits = all_logits
        self._keeps = keeps_logits(model)
        self._argument = _cache_argument(model)
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        # Two calls: every layer allocates its tensors at their real shapes in the first; a tensor
        # attribute of a module that the second call reassigns is state the model keeps there.
        text = model.config.get_text_config()
        _full_windows(self.cache, getattr(text, "model_type", "") or type(text).__name__, max_cache_len)
        with torch.no_grad():
            self._call_once()
            before = _attribute_tensors(model)
            self._call_once()
        self.attributes = tuple(
            AttributeSlot(path, name, _buffer_name(path, name))
            for (path, name), tensor in _attribute_tensors(model).items()
            if before.get((path, name)) is not tensor
        )
        for slot in self.attributes:
            self.register_buffer(slot.buffer, torch.zeros_like(slot.read(model)), persistent=False)
        slots: list[StateSlot] = []
        for i, layer in enumerate(self.cache.layers):
            found = list(_tensors(layer))
            if not found and not isinstance(layer, DummyLayer) and not self.attributes:
                kind = getattr(model.config.get_text_config(), "model_type", type(model).__name__)
                raise StatesUnsupported(
                    f"model type {kind!r}: cache layer {i} ({type(layer).__name__}) holds no tensor after a call, "
                    "so the model keeps that layer's state somewhere else (its modules' attributes or a cache of "
                    "its own), which no exported program would carry between calls; it would export once "
                    "transformers keeps that state in the layer's cache class"
                )
            several = {a for a, k, _ in found if k is not None and sum(1 for b, _, _ in found if b == a) > 1}
            for attribute, index, tensor in found:
                name = f"layer{i}_{attribute}" + (f"_{index}" if attribute in several else "")
                self.register_buffer(name, torch.zeros_like(tensor), persistent=False)
                slots.append(StateSlot(i, attribute, index, name))
            carried = getattr(layer, "has_previous_state", None)
            if isinstance(carried, dict):
                for index in carried:
                    carried[index] = True
        self.slots = tuple(slots)
        self._bind()

    def _call_once(self) -> None:
        ids = torch.zeros(1, 1, dtype=torch.int64)
        self.model(input_ids=ids, use_cache=True, **{self._argument: self.cache})

    def _bind(self) -> None:
        for slot in self.slots:
            slot.bind(self.cache.layers[slot.layer], getattr(self, slot.buffer))
        for attribute in self.attributes:
            attribute.bind(self.model, getattr(self, attribute.buffer))

    def _write_back_attributes(self) -> None:
        """Each module attribute the call reassigned: its new value written into its buffer
        (``copy_``: a buffer mutation in the exported program)."""
        for attribute in self.attributes:
            buffer = getattr(self, attribute.buffer)
            new = attribute.read(self.model)
            if new is buffer:
                continue
            if not isinstance(new, torch.Tensor) or new.shape != buffer.shape or new.dtype != buffer.dtype:
                raise StateLostError(
                    f"state {attribute.buffer} ({attribute.path}.{attribute.name}, {list(buffer.shape)} "
                    f"{buffer.dtype}) was set by the model to "
                    f"{f'{list(new.shape)} {new.dtype}' if isinstance(new, torch.Tensor) else type(new).__name__}: "
                    "the exported program holds it at one shape and dtype; this model cannot be exported this way"
                )
            buffer.copy_(new)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        if n != 1:
            raise ValueError(
                f"input_ids holds {n} tokens; this model takes one token per call (its layers take another "
                "path for several tokens that does not continue from the carried state)"
            )
        # The layers write the buffers as this call sees them (torch.export traces the module's
        # attributes, not tensors held elsewhere). The attributes are left as the call found them
        # (the buffers themselves, not the traced stand-ins torch.export puts in their place).
        found = [attribute.read(self.model) for attribute in self.attributes]
        self._bind()
        logits = causal_lm_logits(
            self.model,
            self.all_logits,
            self._keeps,
            input_ids=input_ids,
            position_ids=cache_position.unsqueeze(0),
            use_cache=True,
            **{self._argument: self.cache},
        )
        self._write_back_attributes()
        for attribute, held in zip(self.attributes, found, strict=True):
            attribute.bind(self.model, held)
        for slot in self.slots:
            held = slot.read(self.cache.layers[slot.layer])
            if held is not getattr(self, slot.buffer):
                raise StateLostError(
                    f"state {slot.buffer} (cache layer {slot.layer}, {slot.attribute}"
                    f"{'' if slot.index is None else f'[{slot.index}]'}) was replaced by the model's "
                    f"{type(self.cache.layers[slot.layer]).__name__} instead of written in place: the exported "
                    "program would not carry it to the next call; this model cannot be exported this way"
                )
        return logits
