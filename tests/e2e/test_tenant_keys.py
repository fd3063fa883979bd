"""Tenants on a real `inferd serve`: the official openai client sees the rate limit as OpenAI's
(RateLimitError, code rate_limit_exceeded, the x-ratelimit-* headers), and SIGHUP reloads the
keys and tenants without a restart (a bad file is refused and the old keys keep serving)."""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path

import openai
import pytest
from serveproc import start_server, stop_server

pytestmark = pytest.mark.served  # it starts a real server


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenant(name: str, key: str, extra: str = "") -> str:
    return f'[tenants.{name}]\nkey_sha256 = ["{sha(key)}"]\n{extra}\n'


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def complete(url: str, key: str) -> openai.types.Completion:
    return client(url, key).completions.create(model="smollm2", prompt="Hello", max_tokens=1, temperature=0)


def test_rate_limits_through_the_openai_client_and_sighup_reloads(tmp_path: Path) -> None:
    config = tmp_path / "inferd.toml"
    config.write_text('[model]\nname = "smollm2"\n\n' +
                      tenant("acme", "sk-acme", "requests_per_second = 0.05\nrequests_burst = 1"))
    server = start_server(tmp_path, "--config", str(config))
    try:
        raw = client(server.url, "sk-acme").completions.with_raw_response.create(
            model="smollm2", prompt="Hello", max_tokens=1)
        assert raw.headers["x-ratelimit-limit-requests"] == "1"
        assert raw.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as refused:
            complete(server.url, "sk-acme")
        assert refused.value.code == "rate_limit_exceeded"
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        with pytest.raises(openai.AuthenticationError):
            complete(server.url, "sk-beta")

        # a second tenant appears on SIGHUP; acme's bucket keeps its level
        config.write_text(config.read_text() + tenant("beta", "sk-beta"))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert complete(server.url, "sk-beta").choices
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline, server.log.read_text()
                time.sleep(0.1)
        with pytest.raises(openai.RateLimitError):
            complete(server.url, "sk-acme")

        # a bad file is refused: the log says why, the old keys serve on
        config.write_text(config.read_text() + tenant("gamma", "sk-gamma", 'classes = ["gold"]'))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload refused" not in server.log.read_text():
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.1)
        assert "unknown classes ['gold']" in server.log.read_text()
        assert complete(server.url, "sk-beta").choices
        with pytest.raises(openai.AuthenticationError):
            complete(server.url, "sk-gamma")
    finally:
        stop_server(server)
    log = server.log.read_text()
    assert "SIGHUP: keys reloaded: 2 keys, 2 tenants" in log
    for secret in ("sk-acme", "sk-beta", sha("sk-acme"), sha("sk-beta")):
        assert secret not in log
