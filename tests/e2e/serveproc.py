"""`inferd serve` as a real subprocess for the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from inferd.api.startup import StartupLine


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def start_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Server:
    """Start `inferd serve` on a free port; return once it is ready (its start-up line names the
    port, and /ready answers 200 once the start-up inference probe has run, whose tokens would
    otherwise land in a test's counts)."""
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr:  # (the child keeps its own copy of the descriptor)
        proc = subprocess.Popen(
            [sys.executable, "-m", "inferd.cli", "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path, env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = StartupLine.parse(log.read_text())
        if line and _ready(line.url):
            return Server(proc, line.url, log)
        if proc.poll() is not None:
            raise AssertionError(f"inferd serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"inferd serve did not start:\n{log.read_text()}")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
            return r.status == 200
    except OSError:  # (HTTPError for a 503 is an OSError too)
        return False


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        assert server.proc.wait(timeout=30) == 0, server.log.read_text()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
