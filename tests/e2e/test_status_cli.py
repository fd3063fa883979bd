"""`inferd status` as a real subprocess against a real `inferd serve` subprocess.

One server, with an API key, serves every test in this module: each test that should work
passes the key (by flag or by INFERD_API_KEY), and one leaves it out.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from serveproc import Server, start_server, stop_server

MODEL = "statusmodel"
KEY = "secret"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("status"),
        "--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--api-key", KEY,
    )
    yield srv
    stop_server(srv)


def status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "INFERD_API_KEY"}
    return subprocess.run(
        [sys.executable, "-m", "inferd.cli", "status", *args], capture_output=True, text=True, timeout=60,
        env={**environ, **(env or {})},
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------


@pytest.mark.served
def test_once_prints_one_frame(server: Server) -> None:
    # one finished request, so the counters have something in them
    request = urllib.request.Request(
        f"{server.base_url}/completions", method="POST",
        data=b'{"model": "statusmodel", "prompt": "Hello", "max_tokens": 4, "temperature": 0}',
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    urllib.request.urlopen(request, timeout=60).read()
    result = status(server.url, "--once", "--api-key", KEY)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert MODEL in out and "interactive" in out and "batch" in out
    assert "queues" in out and "KV cache" in out and "prefix-cache hit rate" in out and "shed level" in out
    assert "Traceback" not in out + result.stderr


def test_unreachable_server_is_one_line_and_exit_1() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    result = status(url, "--once")
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach" in lines[0] and url in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.served
def test_missing_key_is_one_line_and_exit_1(server: Server) -> None:
    result = status(server.url, "--once")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "API key" in lines[0] and "--api-key" in lines[0], result.stderr
    wrong = status(server.url, "--once", "--api-key", "not-the-key")
    assert wrong.returncode == 1 and "rejected the API key" in wrong.stderr and "Traceback" not in wrong.stderr


@pytest.mark.served
def test_key_from_the_environment(server: Server) -> None:
    result = status(server.url, "--once", env={"INFERD_API_KEY": KEY})
    assert result.returncode == 0, result.stderr
    assert MODEL in result.stdout


@pytest.mark.served
def test_live_dashboard_in_tmux(server: Server) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: the live dashboard needs a terminal to draw into")
    # a private tmux server: the session inherits this environment, and no user session is touched
    tmux = ["tmux", "-L", f"inferd-status-{os.getpid()}"]
    argv = [sys.executable, "-m", "inferd.cli", "status", server.url, "--interval", "0.5"]
    command = " ".join(map(shlex.quote, argv))
    shell = f"{command}; echo EXIT=$?; sleep 60"
    # NOTE: COLUMNS and LINES, where set, describe this process's terminal, not the pane; rich
    # would believe them over the pane's real size
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"INFERD_API_KEY": KEY}
    subprocess.run([*tmux, "new-session", "-d", "-x", "140", "-y", "45", "-s", "status", shell],
                   check=True, timeout=10, env=env)
    try:
        def screen() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-t", "status"], capture_output=True, text=True,
                                  timeout=10).stdout

        deadline = time.monotonic() + 20
        shown = screen()
        while not ("batch" in shown and "updated" in shown) and time.monotonic() < deadline:
            time.sleep(0.5)
            shown = screen()
        assert MODEL in shown and "queues" in shown, shown
        assert max(map(len, shown.splitlines())) > 100, shown  # drawn at the pane's 140 columns
        assert "interactive" in shown and "batch" in shown and "TTFT p50" in shown, shown
        assert "EXIT=" not in shown, shown  # still running: live, not one frame

        subprocess.run([*tmux, "send-keys", "-t", "status", "C-c"], check=True, timeout=10)
        deadline = time.monotonic() + 10
        while "EXIT=" not in (shown := screen()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "EXIT=0" in shown and "Traceback" not in shown, shown
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
