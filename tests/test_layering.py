"""The layering contracts in pyproject.toml's [tool.importlinter], checked by a real lint-imports.

cli > api > engine > model > kernels; the client talks HTTP only; the API's whole import closure is
torch-free; the settings are pure data. `make test` runs lint-imports too; these tests keep the check
inside pytest and prove that it bites: a planted `import torch` in a copy of inferd/api breaks it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
# NOTE: the planted import goes into the api package's __init__.py: it exists whatever the rewrite
# does to the modules inside, and it is empty, so the planted line is l.1 and nothing else is.
PLANTED_CHAIN = "inferd.api -> torch (l.1)"


def _lint_imports() -> str:
    """The lint-imports script installed beside this interpreter (the dev extra brings it)."""
    script = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert script, "lint-imports is not installed in this venv: pip install -e '.[dev]'"
    return script


def _run_lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the `inferd` package under `root` with root's pyproject.toml.

    lint-imports finds `inferd` through sys.path, where the venv's editable install points at the
    main checkout. It puts its cwd first on sys.path, and PYTHONPATH comes before site-packages, so
    with both set to `root` the package under `root` is the one analysed.
    """
    # A wide COLUMNS keeps rich from wrapping contract names in the report.
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}
    return subprocess.run(
        [_lint_imports(), "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _contract_name(contract_id: str) -> str:
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    return next(c["name"] for c in contracts if c["id"] == contract_id)


@pytest.fixture(scope="module")
def real_tree_run() -> subprocess.CompletedProcess[str]:
    return _run_lint_imports(REPO)


def test_the_real_tree_keeps_every_contract(real_tree_run: subprocess.CompletedProcess[str]) -> None:
    if real_tree_run.returncode != 0:
        output = real_tree_run.stdout + real_tree_run.stderr
        pytest.fail(f"lint-imports found broken contracts:\n{output}", pytrace=False)


def test_an_api_module_importing_torch_breaks_the_api_contract(
    tmp_path: Path, real_tree_run: subprocess.CompletedProcess[str]
) -> None:
    shutil.copytree(REPO / "inferd", tmp_path / "inferd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    init = tmp_path / "inferd" / "api" / "__init__.py"
    init.write_text("import torch\n" + init.read_text())

    result = _run_lint_imports(tmp_path)
    output = result.stdout + result.stderr

    assert result.returncode != 0, f"lint-imports passed with torch planted in inferd/api:\n{output}"
    assert f"{_contract_name('api-no-torch')} BROKEN" in output, output
    # The planted chain proves the copy was analysed, not the editable install's checkout.
    assert PLANTED_CHAIN in output, output
    assert PLANTED_CHAIN not in real_tree_run.stdout + real_tree_run.stderr
