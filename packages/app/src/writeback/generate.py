"""``writeback generate model.pte --tokenizer PATH --prompt TEXT``: text generation through
ExecuTorch's own LLM runner (``TextLLMRunner``, the C++ runner ``llama_main`` and the demo
apps use), greedy unless ``--temperature`` says otherwise.

The runner streams the text itself as it decodes; the command then prints the
runner's statistics: prompt and generated tokens, time to first token, prefill and
decode rates.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

__all__ = ["MAX_NEW_TOKENS", "GenerationStats", "RunnerRefused", "generate_command", "generate_text"]

# New tokens when --max-new-tokens is not given (fewer where the cache is shorter).
DEFAULT_NEW_TOKENS = 32
# The runner counts tokens in a C++ int32.
MAX_NEW_TOKENS = (1 << 31) - 1


class RunnerRefused(click.ClickException):
    """ExecuTorch's LLM runner refused the program, the tokenizer or the prompt: exit 2, its reason."""

    exit_code = 2


@dataclass(frozen=True)
class GenerationStats:
    """The runner's statistics of one generation (its own clock, milliseconds).

    ``generated_tokens`` counts the tokens the decode calls made, as the runner does: the
    first new token comes out of the prefill call and is not among them.
    """

    prompt_tokens: int
    generated_tokens: int
    load_ms: int
    first_token_ms: int
    prefill_ms: int
    decode_ms: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else float("inf")

    @classmethod
    def of(cls, stats: Any) -> GenerationStats:
        """From the runner's ``Stats`` (its timestamps are milliseconds)."""
        start = stats.inference_start_ms
        return cls(
            prompt_tokens=int(stats.num_prompt_tokens),
            generated_tokens=int(stats.num_generated_tokens),
            load_ms=int(stats.model_load_end_ms - stats.model_load_start_ms),
            first_token_ms=int(stats.first_token_ms - start),
            prefill_ms=int(stats.prompt_eval_end_ms - start),
            decode_ms=int(stats.inference_end_ms - stats.prompt_eval_end_ms),
        )

    def lines(self) -> list[str]:
        return [
            f"prompt tokens {self.prompt_tokens}; new tokens {self.generated_tokens + 1} "
            f"(1 from the prefill call, {self.generated_tokens} decoded)",
            f"time to first token {self.first_token_ms} ms; model load {self.load_ms} ms",
            f"prefill {self.prefill_tokens_per_s:.1f} tokens/s ({self.prefill_ms} ms), "
            f"decode {self.decode_tokens_per_s:.1f} tokens/s ({self.decode_ms} ms)",
        ]


def _runner() -> Any:
    from writeback_core.llm_runner import load_runner_kernels

    load_runner_kernels()  # a program may call llama::update_cache / custom_sdpa, as the C++ runner links them
    try:
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    except (ImportError, RuntimeError) as error:
        raise click.ClickException(
            f"ExecuTorch's LLM runner is not importable ({error}); it ships in the executorch wheel"
        ) from error
    return GenerationConfig, TextLLMRunner


def generate_text(
    pte: Path,
    tokenizer: Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    on_text: Any = None,
) -> GenerationStats:
    """Generate through ``TextLLMRunner``: the runner prints the text as it decodes (and
    passes each piece to ``on_text`` when given); returns its statistics. A weights file
    beside ``pte`` (its path with ``.ptd``, ``writeback export --separate-weights``) is
    loaded with it.

    :raises RunnerRefused: the runner refused the program, the tokenizer or the prompt; the
        message gives the reason from the runner's own log (exit 2).
    """
    from writeback_core.llm_runner import data_file_beside

    from writeback.generate_checks import runner_log

    config_class, runner_class = _runner()
    data = data_file_beside(pte)
    with runner_log() as log:
        try:
            runner = runner_class(str(pte), str(tokenizer), None if data is None else str(data))
        except RuntimeError as error:
            failure: RuntimeError | None = error
        else:
            failure = None
    if failure is not None:
        hint = ""
        if "backend" in log.text.lower() and "not" in log.text.lower():
            hint = " A program lowered for a delegate the stock runtime lacks (mlx) needs writeback's runtime."
        raise RunnerRefused(
            f"ExecuTorch's LLM runner refused {pte} with tokenizer {tokenizer}: {log.reason()} ({failure}).{hint}"
        ) from failure
    config = config_class(echo=False, max_new_tokens=max_new_tokens, temperature=temperature)
    found: list[Any] = []
    sys.stdout.flush()
    with runner_log() as log:
        try:
            runner.generate(prompt, config, token_callback=on_text, stats_callback=found.append)
        except RuntimeError as error:
            failure = error
        finally:
            sys.stdout.flush()
    if failure is not None:
        raise RunnerRefused(f"ExecuTorch's LLM runner stopped: {log.reason()} ({failure})") from failure
    if not found:
        raise click.ClickException("ExecuTorch's LLM runner reported no statistics: the generation did not finish")
    return GenerationStats.of(found[-1])


def _check_inputs(pte: Path, tokenizer: Path, max_new_tokens: int | None) -> int:
    """Refuse (exit 2) a .pte the runtime cannot read, a tokenizer that cannot be the
    program's, and more new tokens than the program's cache holds, before the runner starts.

    :return: the new tokens to ask for (``max_new_tokens``, or the default the cache allows).
    """
    from writeback.generate_checks import program_limits, tokenizer_problem

    limits, problem = program_limits(pte)
    if problem is not None or limits is None:
        raise click.UsageError(problem or f"{pte}: no runner metadata")
    problem = tokenizer_problem(tokenizer, limits.vocab_size)
    if problem is not None:
        raise click.UsageError(problem)
    if max_new_tokens is None:
        return min(DEFAULT_NEW_TOKENS, max(1, limits.max_context_len - 1))
    if max_new_tokens >= limits.max_context_len:
        raise click.UsageError(
            f"--max-new-tokens {max_new_tokens}: the program's cache holds {limits.max_context_len} positions "
            f"(get_max_context_len), the prompt's tokens included; give at most {limits.max_context_len - 1}"
        )
    return max_new_tokens


@click.command("generate")
@click.argument("pte", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The tokenizer (tokenizer.json, tokenizer.model). Default: tokenizer.json beside the .pte.",
)
@click.option("--prompt", required=True, help="The prompt text.")
@click.option(
    "--max-new-tokens",
    default=None,
    type=click.IntRange(min=1, max=MAX_NEW_TOKENS),
    help="At most this many new tokens, fewer than the program's cache holds (get_max_context_len). "
    f"Default: {DEFAULT_NEW_TOKENS}, or one fewer than the cache holds where that is less.",
)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0.0, max=1.0),
    help="0 for greedy decoding.",
)
def generate_command(
    pte: Path, tokenizer: Path | None, prompt: str, max_new_tokens: int | None, temperature: float
) -> None:
    """Generate text from PTE (written by `writeback export`) in ExecuTorch's own LLM runner,
    streaming it, then print the runner's statistics."""
    if tokenizer is None:
        beside = pte.parent / "tokenizer.json"
        if not beside.is_file():
            raise click.UsageError(f"no tokenizer.json beside {pte}: pass --tokenizer PATH")
        tokenizer = beside
    max_new_tokens = _check_inputs(pte, tokenizer, max_new_tokens)
    stats = generate_text(pte, tokenizer, prompt, max_new_tokens, temperature)
    click.echo()
    for line in stats.lines():
        click.echo(line)
