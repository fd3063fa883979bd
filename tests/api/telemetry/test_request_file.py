"""The request file ([request_log]): one JSON line per finished generation request, streamed or
not, with its numbers and texts; redacted by default, raw on request; rotated at max_bytes;
nothing at all when the section is off."""

from __future__ import annotations

import json
import re
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
from apiserver import MODEL, data_events, serve

from inferd.api.telemetry.request_file import REQUEST_JOURNAL, Redactor
from inferd.settings.config import Settings
from inferd.engine.llm_engine import LLMEngine

EMAIL, PHONE, KEY, IP = "alice.smith@example.com", "+1 (555) 123-4567", "sk-abcdEFGH1234567890xyz", "192.168.10.20"
PII_PROMPT = f"Mail {EMAIL} or call {PHONE}; my key is {KEY}, my host {IP}. Reply:"
ONLY_AN_EMAIL = {"type": "choice", "choice": ["bob@example.org"]}  # the output: nothing but an address


def settings(path: Path, **request_log: Any) -> Settings:
    return Settings.model_validate({"request_log": {"path": str(path), **request_log}})


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_default_patterns_tag_what_they_match() -> None:
    redact = Redactor(Settings().request_log.redact_patterns)
    assert redact(f"to {EMAIL}, cc x_y+z@mail.co.uk") == "to [email], cc [email]"
    assert redact(f"call {PHONE} or 555-123-4567 or 07700 900123") == "call [number] or [number] or [number]"
    assert redact("card 4111 1111 1111 1111, iban 12345678901") == "card [number], iban [number]"
    assert redact(f"key {KEY} and ghp_ABCDEFGHIJ0123456789") == "key [api_key] and [api_key]"
    assert redact(f"from {IP}:8080") == "from [ipv4]:8080"
    unchanged = "Python 3.11 came out in 2022; version 1.2.3 costs $450, see page 12."
    assert redact(unchanged) == unchanged


@pytest.mark.served
@pytest.mark.asyncio
async def test_one_line_per_finished_generation_raw_when_redaction_is_off(llm: LLMEngine, tmp_path: Path) -> None:
    path = tmp_path / "logs" / "requests.jsonl"  # its folder is made
    body = {"model": MODEL, "prompt": [f"One {EMAIL}", "Two"], "n": 2, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "user": "alice", "priority": "batch"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": f"Say hi to {EMAIL}"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    async with serve(llm, settings(path, redact=False)) as server:
        status, reply = await server.post("/v1/completions", body)
        assert status == 200
        r, events = await server.stream("/v1/chat/completions", chat)
        assert r.status == 200
        assert (await server.post("/v1/completions", {**body, "priority": "nope"}))[0] == 400  # refused: no line
        assert (await server.post("/v1/completions", {**body, "n": 1000}))[0] == 400
    whole, streamed = read_lines(path)
    assert whole["id"] == reply["id"] and whole["path"] == "/v1/completions" and whole["status"] == 200
    assert whole["class"] == "batch" and whole["model"] == MODEL and whole["user"] == "alice"
    assert whole["tenant"] is None  # an open server: no tenant
    assert whole["prompt_tokens"] == reply["usage"]["prompt_tokens"] and whole["completion_tokens"] == 16
    assert whole["finish_reasons"] == ["length"] * 4
    assert whole["outputs"] == [c["text"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
    assert 0 <= whole["queue_time"] <= whole["ttft"] <= whole["e2e"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", whole["time"])
    assert EMAIL in whole["prompt"] and "Two" in whole["prompt"]  # raw: redact = false
    chunks = data_events(events)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed["id"] == chunks[0]["id"] and streamed["path"] == "/v1/chat/completions"
    assert streamed["outputs"] == [text] and streamed["finish_reasons"] == ["length"]
    assert streamed["completion_tokens"] == 4 and EMAIL in streamed["prompt"]


@pytest.mark.served
@pytest.mark.asyncio
async def test_redaction_covers_the_prompt_and_the_outputs(llm: LLMEngine, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "requests.jsonl"
    body = {"model": MODEL, "prompt": PII_PROMPT, "max_tokens": 20, "temperature": 0,
            "response_format": ONLY_AN_EMAIL}
    tenant, admin = {"Authorization": "Bearer acme-key"}, {"Authorization": "Bearer admin-key"}
    config = Settings.model_validate({
        "request_log": {"path": str(path)}, "server": {"admin_key_sha256": [sha256(b"admin-key").hexdigest()]},
        "tenants": {"acme": {"key_sha256": [sha256(b"acme-key").hexdigest()]}}})
    async with serve(llm, config) as server:
        status, reply = await server.post("/v1/completions", body, headers=tenant)
        assert status == 200 and reply["choices"][0]["text"] == "bob@example.org"
        r, events = await server.stream("/v1/completions", body, headers=tenant)
        assert r.status == 200
        assert (await server.get("/v1/status", headers=tenant))[1]["drift"] is None  # others' traffic: admins only
        assert (await server.get("/v1/status", headers=admin))[1]["drift"]["baseline_requests"] == 2
    text = path.read_text()
    for raw in (EMAIL, PHONE, KEY, IP, "bob@example.org"):
        assert raw not in text, raw
    lines = read_lines(path)
    assert len(lines) == 2
    for line in lines:
        # The phone's pieces, only where text is logged: the ids and times are random hex and digits.
        logged = line["prompt"] + " ".join(line["outputs"])
        assert "555" not in logged and "4567" not in logged, logged
        assert all(f"[{tag}]" in line["prompt"] for tag in ("email", "number", "api_key", "ipv4")), line["prompt"]
        assert line["outputs"] == ["[email]"] and line["tenant"] == "acme"
    assert EMAIL not in caplog.text  # the stderr lines: no prompt without server.log_prompts


@pytest.mark.served
@pytest.mark.asyncio
async def test_the_file_rotates_at_max_bytes(llm: LLMEngine, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    ids = []
    async with serve(llm, settings(path, max_bytes=1200, backups=2)) as server:
        for i in range(12):
            status, reply = await server.post("/v1/completions", {**body, "prompt": f"Request {i} " + "x" * 200})
            assert status == 200
            ids.append(reply["id"])
    files = [path, path.with_name("requests.jsonl.1"), path.with_name("requests.jsonl.2")]
    assert all(f.exists() and f.stat().st_size <= 1200 for f in files)
    assert not path.with_name("requests.jsonl.3").exists()  # backups = 2: the oldest are gone
    kept = [line["id"] for f in reversed(files) for line in read_lines(f)]
    assert 3 <= len(kept) < 12 and kept == ids[-len(kept):]  # the newest, in order, none torn


@pytest.mark.served
@pytest.mark.asyncio
async def test_nothing_is_kept_when_the_section_is_off(llm: LLMEngine, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with serve(llm) as server:
        assert REQUEST_JOURNAL not in server.test_server.app
        body = {"model": MODEL, "prompt": PII_PROMPT, "max_tokens": 2}
        assert (await server.post("/v1/completions", body))[0] == 200
        assert (await server.stream("/v1/completions", body))[0].status == 200
    assert list(tmp_path.iterdir()) == []
