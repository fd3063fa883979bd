"""bench/agent_clis.sh as a test (soak tier): Codex (`codex exec`, the Responses API) and Claude
Code (`claude -p`, the Messages API), installed from the npm registry, each complete one turn
against a real `inferd serve` on the default model, their prompts trimmed to its 8k context; where
the machine allows it, server and CLIs run in a network namespace that has only 127.0.0.1.
Skipped, with the reason, where npm or the registry cannot be reached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.served  # it starts a real server

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "agent_clis.sh"
CANNOT_INSTALL = 3  # the script's exit code when npm is missing or the install fails


@pytest.mark.soak
def test_codex_and_claude_code_each_complete_a_turn(tmp_path: Path) -> None:
    run = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                         env={**os.environ, "INFERD_PYTHON": sys.executable}, timeout=2 * 900 + 900)
    print(run.stderr[-4000:])
    if run.returncode == CANNOT_INSTALL:
        pytest.skip(f"the agent CLIs cannot be installed from the npm registry here: {run.stderr.strip()[-400:]}")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for cli in ("codex", "claude"):
        assert summary[cli]["exit"] == 0 and summary[cli]["answer"].strip(), (cli, summary[cli], run.stderr[-4000:])
    assert summary["codex"]["version"].endswith("0.169.1") and summary["claude"]["version"].startswith("2.1.")
    seen = {(r["path"], r["status"]) for r in summary["requests"]}
    assert ("/v1/responses", 200) in seen and ("/v1/messages", 200) in seen, summary["requests"]
    assert run.returncode == 0, run.stderr[-4000:]
