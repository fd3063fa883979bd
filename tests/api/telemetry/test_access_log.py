"""One log line per API request when it ends, with its numbers and never its prompt (unless
asked); JSON lines on request."""

from __future__ import annotations

import json
import logging

import pytest
from apiserver import MODEL, Server, serve

from inferd.api.telemetry.access_log import JsonFormatter
from inferd.settings.config import Settings
from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

SECRET = "my secret question about the harbour"


def lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "inferd.requests"]


async def test_each_request_logs_one_line_without_its_prompt(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inferd.requests")
    body = {"model": MODEL, "prompt": SECRET, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "user": "alice", "priority": "batch"}
    status, reply = await server.post("/v1/completions", body)
    assert status == 200
    await server.post("/v1/completions", {**body, "priority": "nope"})
    await server.get("/health")  # probes and scrapes are not logged
    [ok, bad] = lines(caplog)
    assert ok["id"] == reply["id"] and ok["status"] == 200 and ok["path"] == "/v1/completions"
    assert ok["class"] == "batch" and ok["user"] == "alice"
    assert ok["prompt_tokens"] == reply["usage"]["prompt_tokens"] and ok["completion_tokens"] == 5
    assert 0 <= ok["queue_time"] <= ok["ttft"] <= ok["e2e"] and ok["finish"] == "length"
    assert bad["status"] == 400
    assert SECRET not in " ".join(r.getMessage() for r in caplog.records)
    formatted = json.loads(JsonFormatter().format(next(r for r in caplog.records if r.name == "inferd.requests")))
    assert formatted["logger"] == "inferd.requests" and formatted["status"] == 200 and formatted["user"] == "alice"


async def test_prompts_are_logged_only_when_enabled(llm: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inferd.requests")
    settings = Settings.model_validate({"server": {"log_prompts": True}})
    async with serve(llm, settings) as server:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 2}
        assert (await server.post("/v1/chat/completions", chat))[0] == 200
    [line] = lines(caplog)
    assert SECRET in line["prompt"]
