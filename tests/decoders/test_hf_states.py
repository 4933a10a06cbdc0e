"""Recurrent and hybrid Hugging Face folders (Mamba, Mamba2, LFM2, Falcon-H1, Qwen3.5, Qwen3-Next, Bamba,
RecurrentGemma) through writeback's commands: every state of transformers' cache layers (and every
tensor attribute of a module that the forward reassigns) is a program buffer,
``run`` matches eager on xnnpack and portable, and ``export`` then ExecuTorch's ``TextLLMRunner``
gives transformers' own greedy tokens (``generate(do_sample=False)``, its own cache). Families
transformers does not describe with cache layers are refused with exit 2 on every command
(slow tier: transformers and a lowering per family and backend).

Each folder holds random weights from a tiny config and the byte-level BPE tokenizer of
``test_llm_runner``; the seed is chosen so that every greedy step's top-2 margin is well above
float32 noise and no step gives the end-of-sequence token.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main

from tests.decoders.test_llm_runner import NEW_TOKENS, PROMPT, _tokenizer, runner_generates

pytestmark = pytest.mark.slow

_COMMON = {"hidden_size": 64, "num_hidden_layers": 2, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
_ATTENTION = {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_MAMBA2 = {"mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 16}
_LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"],
    "max_position_embeddings": 64,
}

# Each family: its config class and the tiny config's own fields (two layers, hidden 64).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba": ("MambaConfig", {"state_size": 8, "expand": 2, "conv_kernel": 4}),
    "mamba2": (
        "Mamba2Config",
        {
            "num_heads": 8,
            "head_dim": 16,
            "state_size": 8,
            "n_groups": 1,
            "expand": 2,
            "conv_kernel": 4,
            "chunk_size": 16,
        },
    ),
    "lfm2": ("Lfm2Config", {**_ATTENTION, "layer_types": ["conv", "full_attention"], "max_position_embeddings": 64}),
    "falcon_h1": (
        "FalconH1Config",
        {
            **_ATTENTION,
            **_MAMBA2,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "max_position_embeddings": 64,
        },
    ),
    "qwen3_5": ("Qwen3_5TextConfig", {**_ATTENTION, **_LINEAR}),
    # Qwen3.5's layers with a mixture-of-experts MLP (its experts run by transformers' batched_mm).
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            **_ATTENTION,
            **_LINEAR,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "bamba": (
        "BambaConfig",
        {**_ATTENTION, **_MAMBA2, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 32},
    ),
    # Two recurrent blocks and a sliding-window attention one (transformers' own generate needs an
    # attention layer); its recurrent and convolution states are attributes of its modules.
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        {
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "intermediate_size": 128,
            "lru_width": 64,
        },
    ),
}

# The states each family's cache layers hold (layer 0 and 1), as the program's buffers.
# The states XNNPACK computes whole and writes into their own memory (its result planned onto
# the buffer): no copy left for them.
XNNPACK_WRITES = {
    "mamba": ["layer0_conv_states", "layer0_recurrent_states", "layer1_conv_states", "layer1_recurrent_states"],
    "lfm2": ["layer0_conv_states"],
}

STATES = {
    "mamba": ["layer0_conv_states", "layer0_recurrent_states", "layer1_conv_states", "layer1_recurrent_states"],
    "mamba2": ["layer0_conv_states", "layer0_recurrent_states", "layer1_conv_states", "layer1_recurrent_states"],
    "lfm2": ["layer0_conv_states", "layer1_cumulative_length", "layer1_keys", "layer1_values"],
    "falcon_h1": [
        f"layer{i}_{s}"
        for i in (0, 1)
        for s in ("conv_states", "cumulative_length", "keys", "recurrent_states", "values")
    ],
    "qwen3_5": [
        "layer0_conv_states",
        "layer0_recurrent_states",
        "layer1_cumulative_length",
        "layer1_keys",
        "layer1_values",
    ],
    "qwen3_next": [
        "layer0_conv_states",
        "layer0_recurrent_states",
        "layer1_cumulative_length",
        "layer1_keys",
        "layer1_values",
    ],
    "recurrent_gemma": [
        *(f"model_layers_{i}_temporal_block_{s}" for i in (0, 1) for s in ("conv1d_state", "rg_lru_recurrent_states")),
        "layer2_cumulative_length",
        "layer2_keys",
        "layer2_values",
    ],
    "bamba": [
        "layer0_conv_states",
        "layer0_recurrent_states",
        "layer1_cumulative_length",
        "layer1_keys",
        "layer1_values",
    ],
}


def _greedy(model: Any, ids: list[int]) -> tuple[list[int], list[torch.Tensor], float]:
    """transformers' own greedy continuation with its own cache: tokens, each step's logits, the
    smallest top-2 margin."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.logits]
    return out.sequences[0, len(ids) :].tolist(), [s[0] for s in out.logits], min(margins)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[int]]:
    """A family's folder and transformers' greedy tokens for PROMPT."""
    import transformers

    name = request.param
    config_class, fields = FAMILIES[name]
    path = tmp_path_factory.mktemp(name)
    tokenizer = _tokenizer(path)
    config = getattr(transformers, config_class)(vocab_size=tokenizer.get_vocab_size(), **{**_COMMON, **fields})
    ids = tokenizer.encode(PROMPT).ids
    for seed in range(50):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        tokens, _, margin = _greedy(model, ids)
        if margin > 1e-3 and 1 not in tokens:
            break
    else:
        pytest.fail(f"{name}: no seed of 50 gives greedy steps with a top-2 margin above 1e-3")
    model.save_pretrained(path)
    return name, path, tokens


def test_states_decoder_gives_transformers_own_logits_token_by_token(family: tuple[str, Path, list[int]]) -> None:
    """The wrapper ``run`` compares the program with, against transformers' own model and cache."""
    import transformers
    from writeback_decoders.hf_states import StatesDecoder

    name, path, _ = family
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = _tokenizer_ids(path)
    tokens, logits, _ = _greedy(model, ids)
    decoder = StatesDecoder(model, 64)
    assert [b for b, _ in decoder.named_buffers() if b.startswith(("layer", "model_"))] == STATES[name]
    fed = [*ids, *tokens]
    with torch.no_grad():
        for position in range(len(ids) + NEW_TOKENS - 1):
            out = decoder(torch.tensor([[fed[position]]]), torch.tensor([position]))
            step = position - (len(ids) - 1)
            if step >= 0:
                torch.testing.assert_close(out[0, -1], logits[step], rtol=1e-4, atol=1e-4)


def _tokenizer_ids(path: Path) -> list[int]:
    from tokenizers import Tokenizer

    ids: list[int] = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids
    return ids


@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
def test_run_of_a_recurrent_or_hybrid_folder_matches_eager_with_every_state_a_program_buffer(
    family: tuple[str, Path, list[int]], backend: str
) -> None:
    name, path, _ = family
    result = CliRunner().invoke(main, ["run", str(path), "--backend", backend, "--steps", "6"])
    assert result.exit_code == 0, result.output
    assert "all 6 steps match eager PyTorch" in result.output
    assert "prompt prefilled token by token" in " ".join(result.output.split())
    assert f"{len(STATES[name])} mutated states" in result.output, result.output
    flat = " ".join(result.output.split())
    for state in XNNPACK_WRITES.get(name, ()) if backend == "xnnpack" else ():
        assert re.search(
            rf"{state} \([^)]*\): program buffer, written in place by delegate \d+ \(xnnpack\); no copy left", flat
        ), (
            state,
            result.output,
        )


def test_export_of_a_recurrent_or_hybrid_folder_then_the_runner_gives_transformers_greedy_tokens(
    family: tuple[str, Path, list[int]], tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    name, path, tokens = family
    out = tmp_path / "model.pte"
    result = CliRunner().invoke(main, ["export", str(path), "--backend", "xnnpack", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "prefill: one token per call" in result.output
    assert f"{len(STATES[name])} mutated states" in result.output
    pieces, _ = runner_generates(out, tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert pieces == [tokenizer.decode([t]) for t in tokens]


# Families whose state transformers does not keep in its cache layers, and the word of the cause.
REFUSED = {
    "xlstm": ("xLSTMConfig", {"hidden_size": 64, "num_heads": 4, "num_blocks": 2, "vocab_size": 96}, "xLSTMCache"),
}


@pytest.mark.parametrize("command", ["run", "explain", "export", "bench-generate"])
@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_family_without_cache_layers_is_refused_with_exit_2_naming_type_and_cause_writing_nothing(
    tmp_path: Path, model_type: str, command: str
) -> None:
    import transformers

    config_class, fields, cause = REFUSED[model_type]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**fields)).save_pretrained(
        tmp_path / "model"
    )
    args = [command, str(tmp_path / "model")]
    if command == "export":
        args += ["--output", str(tmp_path / "m.pte")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"model type '{model_type}'" in text and cause in text and "would export once" in text, text
    assert "Traceback" not in result.output
    assert not (tmp_path / "m.pte").exists()


def test_explain_of_a_recurrent_folder_lists_every_state_of_its_cache_layers(
    family: tuple[str, Path, list[int]],
) -> None:
    name, path, _ = family
    result = CliRunner().invoke(main, ["explain", str(path)])
    assert result.exit_code == 0, result.output
    # A state a column (few states) or a row (more than fit the width): each named once.
    cells = [
        cell.strip()
        for line in result.output.splitlines()
        for cell in line.strip("┃│").split("┃" if "┃" in line else "│")
    ]
    assert sorted(c for c in cells if re.fullmatch(r"(layer\d+|model_layers)_\w+", c)) == sorted(STATES[name])


# One family: the bench's contenders are the same lowerings run and export test for every family.
@pytest.mark.parametrize("family", ["lfm2"], indirect=True)
def test_bench_generate_of_a_recurrent_folder_gives_one_text_for_every_contender(
    family: tuple[str, Path, list[int]],
) -> None:
    _, path, _ = family
    command = ["bench-generate", str(path), "--rounds", "1", "--prompt-tokens", "3", "--new-tokens", "4"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith(("stock", "writeback"))]
    assert len(rows) >= 2 and any(line.startswith("writeback+xnnpack") for line in rows), result.output
    assert all(" failed: " not in line and "DIFFER" not in line for line in rows), result.output


@pytest.mark.parametrize("command", ["run", "export"])
def test_a_sliding_window_shorter_than_the_cache_is_refused_with_exit_2_naming_layer_and_window(
    tmp_path: Path, command: str
) -> None:
    """transformers' sliding layer counts positions in a Python int: a window of 8 positions cannot
    serve a program of 1,024 (the folder's cache), and a window that holds them all exports."""
    import transformers

    _, fields = FAMILIES["recurrent_gemma"]
    config = transformers.RecurrentGemmaConfig(**{**_COMMON, **fields}, vocab_size=96, attention_window_size=8)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    args = [command, str(tmp_path / "model")]
    if command == "export":
        args += ["--output", str(tmp_path / "m.pte")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "model type 'recurrent_gemma': cache layer 2 is a sliding window of 8 positions" in text, text
    assert "fewer than the program's 1024" in text and "at most 8 positions" in text, text
    assert "Traceback" not in result.output
    assert not (tmp_path / "m.pte").exists()
