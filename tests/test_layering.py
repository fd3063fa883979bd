"""The layering contracts in pyproject.toml's [tool.importlinter], checked by a real lint-imports.

cli > api > engine > model > kernels > settings; the client talks HTTP only; the API's whole import
closure is torch-free; the settings are a leaf; the API's stages and the engine's parts in order; the
API reaches the engine through its face; no tensor in the scheduler or the block manager; pure policy
modules; no import circle anywhere. `make test` runs lint-imports too; these tests keep the check
inside pytest and prove that each contract bites: one planted import per contract, in a copy of the
tree, breaks it (and the planted chain shows the copy was the tree analysed).
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
# contract id -> (file, the line planted at its top, what the report shows of it)
PLANTED = {
    "layers": ("inferd/kernels/reference.py", "import inferd.engine.protocol",
               "inferd.kernels.reference -> inferd.engine.protocol (l.1)"),
    "client-http-only": ("inferd/client/status.py", "import inferd.engine.health",
                         "inferd.client.status -> inferd.engine.health (l.1)"),
    "api-no-torch": ("inferd/api/__init__.py", "import torch", "inferd.api -> torch (l.1)"),
    "config-is-data": ("inferd/settings/values.py", "import inferd.kernels.tensors",
                       "inferd.settings.values -> inferd.kernels.tensors (l.1)"),
    "core-no-serving-libs": ("inferd/model/evaluate.py", "import aiohttp", "inferd.model.evaluate -> aiohttp (l.1)"),
    "api-stages": ("inferd/api/gateway/ratelimit.py", "import inferd.api.routing.routes",
                   "inferd.api.gateway.ratelimit -> inferd.api.routing.routes (l.1)"),
    "api-engine-face": ("inferd/api/body.py", "import inferd.engine.health",
                        "inferd.api.body -> inferd.engine.health (l.1)"),
    "api-no-model": ("inferd/api/record.py", "import inferd.model.families.config",
                     "inferd.api.record -> inferd.model.families.config (l.1)"),
    "text-leaf": ("inferd/text/detokenizer.py", "import torch", "inferd.text.detokenizer -> torch (l.1)"),
    "kernel-face": ("inferd/model/sampler.py", "import inferd.kernels.cpu", "inferd.model.sampler -> inferd.kernels.cpu (l.1)"),
    "device-rooms": ("inferd/kernels/cpu/build.py", "import inferd.kernels.cuda.launch",
                     "inferd.kernels.cpu.build -> inferd.kernels.cuda.launch (l.1)"),
    "engine-order": ("inferd/engine/kv/prefix_cache.py", "import inferd.engine.structured",
                     "inferd.engine.kv.prefix_cache -> inferd.engine.structured (l.1)"),
    "no-tensors": ("inferd/engine/sched/plan.py", "import torch", "inferd.engine.sched.plan -> torch (l.1)"),
    "pure-policy": ("inferd/api/admission/queues.py", "import asyncio",
                    "inferd.api.admission.queues -> asyncio (l.1)"),
    # layers/quant.py is imported by decoder.py: planted, model.layers and model.decoder form a circle
    "no-circles": ("inferd/model/layers/quant.py", "import inferd.model.decoder", "- .layers -> .decoder (1 import)"),
}


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


def test_every_contract_has_a_planted_import() -> None:
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    assert sorted(c["id"] for c in contracts) == sorted(PLANTED)


def test_each_contract_breaks_on_a_planted_import(
    tmp_path: Path, real_tree_run: subprocess.CompletedProcess[str]
) -> None:
    shutil.copytree(REPO / "inferd", tmp_path / "inferd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    for relpath, line, _ in PLANTED.values():
        planted = tmp_path / relpath
        planted.write_text(f"{line}\n" + planted.read_text())

    result = _run_lint_imports(tmp_path)
    output = result.stdout + result.stderr

    assert result.returncode != 0, f"lint-imports passed with every planted import:\n{output}"
    real = real_tree_run.stdout + real_tree_run.stderr
    for contract_id, (relpath, _, shown) in PLANTED.items():
        assert f"{_contract_name(contract_id)} BROKEN" in output, (contract_id, output)
        assert shown in output, (contract_id, output)
        # the planted chain proves the copy was analysed, not the editable install's checkout
        assert shown not in real, contract_id
