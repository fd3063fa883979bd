"""bench/soak.py as a test: mixed traffic on a real `inferd serve` (two tenants at their limits,
streams, whole replies, disconnects, resumable streams dropped and resumed, structured outputs,
tool calls, a SIGHUP reload halfway), then KV blocks, resumable streams, file descriptors and
threads back to their idle values, and the resident memory grown less than 5% after warming up.
The soak tier runs it for 30 minutes; the default tier's twin for 6 seconds, the same checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.served  # it starts a real server

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


@pytest.mark.parametrize("minutes", [pytest.param(30, marks=pytest.mark.soak), 0.1])
def test_mixed_traffic_gives_back_everything_it_held(minutes: float) -> None:
    run = subprocess.run([sys.executable, str(SOAK), "--minutes", str(minutes)], capture_output=True, text=True,
                         timeout=minutes * 60 + 600)
    print(run.stdout[-4000:])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "PASS" in run.stdout
