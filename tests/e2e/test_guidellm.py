"""guidellm 0.8.1 (the vLLM project's benchmark tool, in its own venv: bench/guidellm_run.sh)
against a real `inferd serve`: every request of a short synchronous run succeeds. It streams
with `stream_options.continuous_usage_stats` and reads usage from each chunk; before inferd took
that field, it completed 0 of 20. Soak tier: the first run installs guidellm with its datasets and
pandas stack, over the CPU build of torch."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.served  # it starts a real server

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "guidellm_run.sh"


@pytest.mark.soak
def test_a_short_guidellm_run_completes_every_request() -> None:
    if shutil.which("curl") is None:
        pytest.skip("bench/guidellm_run.sh needs curl")
    run = subprocess.run(["bash", str(SCRIPT), "--requests", "20"], capture_output=True, text=True, timeout=1800)
    if run.returncode != 0 and "Could not find a version" in run.stderr:
        pytest.skip("guidellm could not be installed from the package index: " + run.stderr[-300:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "guidellm: 20 successful, 0 errored, 0 incomplete"
