"""`INFERD_FAULTS` reaches a real `inferd serve`, and is refused when it names no known fault."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from serveproc import start_server, stop_server  # noqa: E402  (tests/e2e's real-subprocess helpers)

from inferd.engine.worker.faults import FaultInjector  # noqa: E402

SERVE_ARGS = ("--served-model-name", "smollm2", "--kv-cache-memory", "32MiB",
              "--probe-interval", "0")


def post(url: str, prompt: str) -> tuple[int, dict]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.served
def test_the_environment_variable_arms_a_real_server_and_it_logs_so(tmp_path: Path) -> None:
    server = start_server(tmp_path, *SERVE_ARGS, env={"INFERD_FAULTS": '{"fail_marker": "XYZZY"}'})
    try:
        status, reply = post(server.url, "XYZZY hello")
        assert status == 500 and reply["error"]["code"] == "internal_error"
        status, reply = post(server.url, "Hello")
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
    finally:
        stop_server(server)
    assert "fault injection is on" in server.log.read_text()


def test_unset_it_is_off_and_an_unknown_fault_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERD_FAULTS", raising=False)
    assert FaultInjector.from_environ() is None
    monkeypatch.setenv("INFERD_FAULTS", '{"forward_failures": 2}')
    assert FaultInjector.from_environ() == FaultInjector(forward_failures=2)
    monkeypatch.setenv("INFERD_FAULTS", '{"explode": true}')
    with pytest.raises(ValueError, match="unknown faults \\['explode'\\]"):
        FaultInjector.from_environ()
