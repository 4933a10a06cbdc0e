"""writeback-decoders' models in eager PyTorch: offered through the entry point, seeded weights,
greedy decode steps worked out by an independent eager loop, caches sized to the MiB asked for,
local model folders loaded without running or unpickling anything from them."""

from __future__ import annotations

import pytest
import torch
from writeback_core.registry import load_registry
from writeback_decoders import (
    ETLlamaConfig,
    GreedyTokens,
    et_llama_case,
    sized_case,
)

from tests.decoders.cases import cache_bytes, call, fed

NAMES = ["et-llama", "hf-llama", "hf-qwen3", "hf-gemma"]
# Importing transformers alone takes 10 s or more here: the Hugging Face models run in the slow tier.
MODELS = [pytest.param(n, marks=[pytest.mark.slow] if n.startswith("hf-") else []) for n in NAMES]


def test_the_entry_point_offers_every_model_beside_the_zoo() -> None:
    models = load_registry().models()
    assert set(NAMES) <= set(models)
    assert "decoder" in models  # core's zoo is still there
    for name in NAMES:
        assert models[name].name == name


@pytest.mark.parametrize("name", MODELS)
def test_build_twice_gives_the_same_seeded_weights(name: str) -> None:
    case = load_registry().models()[name]
    first, second = case.build().state_dict(), case.build().state_dict()
    assert first.keys() == second.keys()
    weights = [k for k, v in first.items() if v.is_floating_point() and v.dim() == 2 and "cache" not in k]
    assert weights
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert any(first[k].abs().sum() > 0 for k in weights)


def test_another_seed_gives_other_weights() -> None:
    first = et_llama_case(config=ETLlamaConfig(seed=0)).build().state_dict()
    other = et_llama_case(config=ETLlamaConfig(seed=1)).build().state_dict()
    assert not torch.equal(first["tok_embeddings.weight"], other["tok_embeddings.weight"])


def test_build_leaves_the_callers_random_stream_as_it_was() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    load_registry().models()["et-llama"].build()
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("name", MODELS)
def test_each_step_feeds_back_the_token_eager_picked_at_the_step_before(name: str) -> None:
    case = load_registry().models()[name]
    module = case.build().eval()
    token, position = fed(case, 0)
    assert (token, position) == (1, 0)
    for step in range(6):
        logits = call(case, module, step)
        expected = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
        assert fed(case, step + 1) == (expected, step + 1), step
    tokens = [fed(case, s)[0] for s in range(7)]
    assert len(set(tokens)) > 1, f"{name} feeds one token every step: {tokens}"


def test_inputs_are_a_pure_function_of_the_step() -> None:
    case = load_registry().models()["et-llama"]
    later = [fed(case, s) for s in (5, 2, 0, 5)]
    assert later[0] == later[3]
    assert [p for _, p in later] == [5, 2, 0, 5]


def test_positions_start_over_once_every_cache_slot_is_written() -> None:
    greedy = GreedyTokens(lambda: torch.nn.Identity(), lambda m, t, p: torch.zeros(1, 4), max_seq=32)
    assert [greedy.position(s) for s in (0, 31, 32, 33, 65)] == [0, 31, 0, 1, 1]


def test_greedy_tokens_refuse_a_negative_step() -> None:
    greedy = GreedyTokens(lambda: torch.nn.Identity(), lambda m, t, p: torch.zeros(1, 4), max_seq=8)
    with pytest.raises(ValueError, match="decode step must be >= 0, got -1"):
        greedy.token(-1)


def test_greedy_tokens_take_observed_logits_and_build_no_eager_copy() -> None:
    """Handed each step's logits, the next token is their argmax and the model is never built;
    a step observed out of order is ignored (its token is not the next one)."""
    builds: list[int] = []

    def build() -> torch.nn.Module:
        builds.append(1)
        return torch.nn.Identity()

    greedy = GreedyTokens(build, lambda m, t, p: torch.zeros(1, 4), max_seq=8, prompt=3)
    greedy.observe(0, torch.tensor([[[0.0, 0.5, 2.0, 1.0]]]))  # argmax 2, worked out by hand
    greedy.observe(2, torch.tensor([[[9.0, 0.0, 0.0, 0.0]]]))  # step 2's token is not known yet: ignored
    greedy.observe(1, torch.tensor([[[0.0, 0.0, 0.0, 0.1]], [[0.0, 7.0, 0.0, 0.0]]]))  # the last row counts
    assert [greedy.token(s) for s in range(3)] == [3, 2, 1]
    greedy.observe(0, torch.tensor([[[5.0, 0.0, 0.0, 0.0]]]))  # step 1's token is known: kept
    assert greedy.token(1) == 2
    assert builds == []


@pytest.mark.parametrize(
    ("name", "mib", "positions"),
    [
        ("et-llama", 2, 32),
        pytest.param("hf-llama", 1, 16, marks=pytest.mark.slow),
        pytest.param("hf-gemma", 4, 64, marks=pytest.mark.slow),
    ],
)
def test_sized_cache_holds_the_mib_asked_for(name: str, mib: float, positions: int) -> None:
    # 4 layers x (K + V) x 16 heads x 128 x fp32 = 64 KiB per position.
    case = sized_case(name, mib)
    module = case.build()
    assert cache_bytes(module) == mib * (1 << 20)
    assert f"{positions} positions" in case.description


@pytest.mark.parametrize("name", ["et-lfm2", "et-qwen3.5"])
def test_a_sized_hybrid_keeps_its_layer_kinds_and_its_attention_caches_hold_the_mib(name: str) -> None:
    # 4 layers alternating state and attention: 2 attention layers x (K + V) x 16 heads x 128 x
    # fp32 = 32 KiB per position; 2 MiB is 64 positions.
    case = sized_case(name, 2)
    module = case.build()
    assert cache_bytes(module) == 2 * (1 << 20)
    assert "64 positions" in case.description
    kinds = "(conv, full_attention, conv, full_attention)" if name == "et-lfm2" else "(linear_attention, full_attention"
    assert kinds in case.description


def test_sized_positions_are_rounded_down() -> None:
    # 2.05 MiB at 64 KiB per position is 32.8 positions: 32 are taken, 2 MiB.
    case = sized_case("et-llama", 2.05)
    assert "32 positions" in case.description
    assert cache_bytes(case.build()) == 2 * (1 << 20)


@pytest.mark.parametrize("name", MODELS)
def test_the_named_models_are_tiny(name: str) -> None:
    """2 layers, hidden 64, 32 positions: K and V of 2 KV heads of 16 per layer, fp32."""
    module = load_registry().models()[name].build()
    embedding = next(m for m in module.modules() if isinstance(m, torch.nn.Embedding))
    assert embedding.embedding_dim == 64
    assert cache_bytes(module) == 2 * 2 * (2 * 16) * 32 * 4


def test_sized_case_refuses_an_unknown_name_listing_the_sizable_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"no sized model 'decoder'; writeback-decoders sizes: et-lfm2, et-llama, et-qwen3\.5, hf-gemma",
    ):
        sized_case("decoder", 1)


def test_cache_mib_of_run_and_bench_sizes_a_plugins_model() -> None:
    # `writeback run et-llama --cache-mib 2` and `bench --model et-llama --cache-mib 2` resolve
    # the model through run's resolution, which asks the offered case to size itself.
    from writeback.run import resolve_case

    case = resolve_case(load_registry(), "et-llama", 2)
    assert cache_bytes(case.build()) == 2 * (1 << 20)
    assert "32 positions" in case.description


def test_cache_mib_for_a_model_without_a_cache_is_a_clear_error_naming_the_sized_models() -> None:
    import click
    from writeback.run import resolve_case

    with pytest.raises(click.UsageError, match=r"model 'ema' has no cache size to set; .*decoder, .*et-llama"):
        resolve_case(load_registry(), "ema", 2)


def test_bench_model_from_step_0_takes_greedy_tokens_from_the_rows_and_builds_no_eager_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`bench --model et-llama` from step 0: the reference and the timed rows hand their logits
    to the case, so its greedy tokens never need a private eager copy (a real-size model's
    weights once more). Models built: the eager reference, the export, the eager row."""
    from writeback_bench.model_steps import run_model_bench
    from writeback_decoders import et_llama

    built: list[int] = []
    original = et_llama._build

    def counting(*args: object, **kwargs: object) -> torch.nn.Module:
        built.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(et_llama, "_build", counting)
    case = et_llama_case()
    # The greedy tokens come from the rows whatever the backend: the portable kernels lower fastest.
    result = run_model_bench(load_registry(), case, steps=3, contenders=["eager", "writeback+portable"])
    assert [(row.name, row.error, len(row.times)) for row in result.rows] == [
        ("eager", None, 3),
        ("writeback+portable", None, 3),
    ]
    assert len(built) == 3, f"{len(built)} models built; a greedy eager copy was built beside the rows"
