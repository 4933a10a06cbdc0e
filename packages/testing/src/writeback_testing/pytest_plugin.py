"""pytest plugin: run writeback's backend contract against your own backend, in your own suite.

Enable it in your root ``conftest.py`` and collect the ready-made test in one test module::

    # conftest.py
    pytest_plugins = ["writeback_testing.pytest_plugin"]

    # tests/test_writeback_contract.py
    from writeback_testing.pytest_plugin import test_writeback_contract  # noqa: F401 (collected)

Then name the backend(s) to check, in ``pyproject.toml``::

    [tool.pytest.ini_options]
    writeback_backends = ["example"]

or on the command line (``--writeback-backend example``, repeatable; it overrides the ini
list). With neither, every backend the installed plugins offer is checked.
``--writeback-programs N`` adds N generated programs (seeded, so a failure reproduces) to
the built-in models. Each (backend, program) pair is one test,
``test_writeback_contract[<backend>-<program>]``: the program is lowered through writeback's
one lowering path with the backend, every accepted mutation must have lost its write-back
and every declined one kept it, and every output and state must match eager PyTorch after
each call, in the caller-writing runtime and in stock ``executorch.runtime``
(:func:`writeback_testing.contract.check_backend_contract`).

Fixtures: ``writeback_registry`` (the installed plugins, loaded once per session),
``writeback_backend`` and ``writeback_program`` (the parametrization above).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from writeback_core.registry import Registry

    from writeback_testing.contract import ContractCase

__all__ = ["test_writeback_contract"]

_BACKENDS_INI = "writeback_backends"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("writeback", "writeback backend contract")
    group.addoption(
        "--writeback-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="backend to run the writeback contract against (repeatable; default: the ini list, else all)",
    )
    group.addoption(
        "--writeback-programs",
        type=int,
        default=0,
        metavar="N",
        help="also check N generated programs (seeded) besides the built-in models",
    )
    parser.addini(_BACKENDS_INI, "backends the writeback contract checks (default: every backend offered)", "args")


def _registry() -> Registry:
    from writeback_core.registry import load_registry

    return load_registry()


@pytest.fixture(scope="session")
def writeback_registry() -> Registry:
    """The installed plugins (entry points), loaded once for the session."""
    return _registry()


_BACKENDS = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    """Check the backends asked for before collection: a wrong name is a usage error."""
    asked: list[str] = list(config.getoption("--writeback-backend")) or list(config.getini(_BACKENDS_INI))
    if int(config.getoption("--writeback-programs")) < 0:
        raise pytest.UsageError(
            f"--writeback-programs must be 0 or more, got {config.getoption('--writeback-programs')}"
        )
    offered = sorted(_registry().backends())
    unknown = [name for name in asked if name not in offered]
    if unknown:
        raise pytest.UsageError(
            f"writeback contract: no installed plugin offers backend(s) {unknown}; offered: {offered or 'none'}. "
            "Install the backend's package, or fix the name in --writeback-backend / writeback_backends"
        )
    config.stash[_BACKENDS] = asked or offered


def _programs(config: pytest.Config) -> list[ContractCase]:
    from writeback_testing.contract import ContractCase, zoo_cases

    cases = zoo_cases()
    count = int(config.getoption("--writeback-programs"))
    if count:
        from hypothesis import HealthCheck, given, settings

        from writeback_testing.program_spec import ProgramSpec, build
        from writeback_testing.strategies import programs

        drawn: list[ProgramSpec] = []

        @settings(max_examples=count, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
        @given(programs())
        def draw(spec: ProgramSpec) -> None:
            drawn.append(spec)

        draw()
        cases += [ContractCase(f"generated-{i}", build(spec)) for i, spec in enumerate(drawn)]
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "writeback_backend" not in metafunc.fixturenames:
        return
    backends = metafunc.config.stash[_BACKENDS]
    programs = _programs(metafunc.config) if "writeback_program" in metafunc.fixturenames else []
    pairs = [(backend, case) for backend in backends for case in programs]
    metafunc.parametrize(
        ("writeback_backend", "writeback_program"), pairs, ids=[f"{b}-{c.name}" for b, c in pairs], scope="function"
    )


def test_writeback_contract(writeback_registry: Registry, writeback_backend: str, writeback_program: Any) -> None:
    """The backend keeps writeback's contract on one program (see the module docstring)."""
    from writeback_testing.contract import check_backend_contract

    check_backend_contract(writeback_registry, writeback_backend, writeback_program.built)
