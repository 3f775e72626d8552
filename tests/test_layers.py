"""The layers of pyproject.toml's import-linter contracts hold: no module imports one above it, so
there is no import cycle between them; and a contract broken on purpose fails."""

import tomllib
from pathlib import Path

import pytest

lint = pytest.importorskip("importlinter.cli", reason="import-linter is a test dependency: pip install -e '.[test]'")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def run_lint(config: Path) -> int:
    return lint.lint_imports(config_filename=str(config), no_cache=True, no_logo=True)


def test_the_layer_contracts_are_kept():
    assert run_lint(PYPROJECT) == 0


def test_a_layer_contract_broken_on_purpose_fails(tmp_path):
    """The same contracts with two layers swapped: the engine imports proposers, so putting proposers
    above the engine must be reported."""
    text = PYPROJECT.read_text()
    assert '"engine | builder",' in text and '"proposers | verifiers",' in text
    swapped = (text.replace('"engine | builder",', "@@ENGINE@@").replace('"proposers | verifiers",', '"engine | builder",')
               .replace("@@ENGINE@@", '"proposers | verifiers",'))
    config = tmp_path / "pyproject.toml"
    config.write_text(swapped)
    assert tomllib.loads(swapped)["tool"]["importlinter"]["contracts"][0]["layers"].index("proposers | verifiers") < \
        tomllib.loads(swapped)["tool"]["importlinter"]["contracts"][0]["layers"].index("engine | builder")
    assert run_lint(config) != 0
