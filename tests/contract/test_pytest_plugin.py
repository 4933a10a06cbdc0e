"""writeback-testing's pytest plugin, as a third-party backend enables it in its own suite:
an inner pytest run (pytester) with the plugin, the ready-made contract test and the real
installed plugins (entry points), checking the example backend."""

from __future__ import annotations

import pytest

CONFTEST = 'pytest_plugins = ["writeback_testing.pytest_plugin"]\n'
TEST = "from writeback_testing.pytest_plugin import test_writeback_contract  # noqa: F401\n"


def _suite(pytester: pytest.Pytester, ini_backends: str | None) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_backend_contract=TEST)
    if ini_backends is not None:
        pytester.makeini(f"[pytest]\nwriteback_backends = {ini_backends}\n")


@pytest.mark.slow
def test_the_plugin_runs_the_contract_on_every_builtin_model_for_the_ini_backend(pytester: pytest.Pytester) -> None:
    _suite(pytester, "example")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    # One test per built-in model: decoder, decoder-caller-cache, recurrent, ema, no-input.
    result.assert_outcomes(passed=5)
    result.stdout.no_fnmatch_line("*mlx*")


def test_an_unknown_backend_is_a_usage_error_listing_what_is_offered(pytester: pytest.Pytester) -> None:
    _suite(pytester, None)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "--writeback-backend", "nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (
        "no installed plugin offers backend(s) ['nope']; offered: ['example', 'mlx', 'portable', 'xnnpack']"
        in result.stderr.str()
    )


@pytest.mark.slow
def test_a_broken_setup_fails_the_plugins_tests(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's tests can fail: with writeback-passes blocked, nothing drops the write-backs
    of the mutations the example backend accepts, so its contract is broken."""
    _suite(pytester, "example")
    monkeypatch.setenv("WRITEBACK_BLOCK_PLUGINS", "passes")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*ContractViolation: backend 'example' accepted to write*"])


_MODELS = ["decoder", "decoder-caller-cache", "recurrent", "ema", "no-input"]


def _collected(result: pytest.RunResult) -> list[str]:
    return sorted(
        line.split("[", 1)[1].rstrip("]") for line in result.stdout.lines if "::test_writeback_contract[" in line
    )


def test_the_command_line_backend_overrides_the_ini_list_and_programs_add_generated_ones(
    pytester: pytest.Pytester,
) -> None:
    _suite(pytester, "example")
    args = ("--collect-only", "-q", "-p", "no:cacheprovider", "--writeback-backend", "portable")
    result = pytester.runpytest_subprocess(*args, "--writeback-programs", "2")
    assert _collected(result) == sorted(
        [*(f"portable-{m}" for m in _MODELS), "portable-generated-0", "portable-generated-1"]
    )


def test_with_neither_option_nor_ini_every_installed_backend_is_checked(pytester: pytest.Pytester) -> None:
    _suite(pytester, None)
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    backends = ["example", "mlx", "portable", "xnnpack"]
    assert _collected(result) == sorted(f"{b}-{m}" for b in backends for m in _MODELS)
