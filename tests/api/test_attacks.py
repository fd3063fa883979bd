"""The one-request attacks peers shipped CVEs for in 2026, sent as an attacker would, over a real
socket to a server that requires a key. Each must get its protocol's 4xx (or a correct answer),
never a 5xx, a hang, an address from the heap, a dead engine or a held KV block:

    counts of a million or a billion          (vLLM CVE-2026-34756: `n` copied on the event loop)
    Host headers with / and ?, path variants  (CVE-2026-48746: the auth check moved off the path)
    HEAD and OPTIONS on protected paths
    garbage JSON, broken schemas, deep nesting
    every sampling and structure option at once (CVE-2026-44223: a combination killed the engine)
    error messages with no heap address       (CVE-2026-22778)
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from apiserver import MODEL, serve

from inferd.api.gateway.keys import load_api_keys
from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

KEY = "sk-attacks"
ADDRESS = re.compile(rb"0x[0-9a-fA-F]{6,}")  # what a repr() of an object would leak


def raw(method: str, path: str, host: str = "localhost", body: bytes = b"", key: bool = False) -> bytes:
    auth = f"Authorization: Bearer {KEY}\r\n" if key else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


COMPLETION = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()

# (method, path, Host header): no key, so each must be refused (401), or not found (404/405),
# never answered
UNKEYED = [
    ("POST", "/v1/completions", "evil/"),
    ("POST", "/v1/completions", "a?b"),
    ("POST", "/v1/completions", "localhost/health"),
    ("POST", "//v1/completions", "localhost"),
    ("POST", "/v1%2fcompletions", "localhost"),
    ("POST", "/V1/Completions", "localhost"),
    ("POST", "/v1/completions/", "localhost"),
    ("POST", "/v1/../v1/completions", "localhost"),
    ("POST", "/health/../v1/completions", "localhost"),
    ("POST", "/health?x=/v1/completions", "localhost"),
    ("HEAD", "/v1/models", "localhost"),
    ("OPTIONS", "/v1/completions", "localhost"),
    ("GET", "/admin/tenants", "localhost"),
]

SAMPLING_AND_STRUCTURE = {
    "model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "n": 2,
    "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "seed": 7, "stop": ["\n\n", "###"],
    "logit_bias": {"42": 5, "17": -100}, "logprobs": True, "top_logprobs": 3,
    "tools": [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}],
    "tool_choice": "required", "parallel_tool_calls": True, "stream": True, "stream_options": {"include_usage": True},
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": {
    "type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}}}

# (path, body): each a 4xx in its protocol's shape, or a 200
BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 1_000_000}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 1_000_000_000}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 10**9}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 10**9}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 10**6}),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 1_000_000}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": ["x"] * 100_000}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logit_bias": {str(i): 1 for i in range(100_000)}}),
    # (Anthropic's clients send a max_tokens over the context, as Claude Code does: clamped, so it streams)
    ("/v1/messages", {"model": MODEL, "max_tokens": 10**9, "messages": [{"role": "user", "content": "x"}],
                      "stream": True}),
    ("/v1/embeddings", {"model": MODEL, "input": ["x"] * 1_000_000}),
    ("/v1/chat/completions", SAMPLING_AND_STRUCTURE),
    ("/v1/chat/completions", {**SAMPLING_AND_STRUCTURE, "tools": None, "tool_choice": None, "stream": False,
                              "response_format": JSON_SCHEMA}),
    ("/v1/chat/completions", {**SAMPLING_AND_STRUCTURE, "response_format": JSON_SCHEMA}),
]

GARBAGE = [b"{", b"[1, 2]", b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
           b'{"model": "smollm2", "prompt": 12.5}', b'{"model": "smollm2", "messages": "x"}', b"\xff\xfe\x00"]


async def send(host: str, port: int, request: bytes) -> tuple[int, bytes]:
    """Status and body; of an event stream, its head only: then the client leaves (which must free
    what the stream held)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        async with asyncio.timeout(60):
            head_part = (await reader.readuntil(b"\r\n\r\n")).decode()
            status = int(head_part.split()[1])
            length = re.search(r"(?i)content-length: *(\d+)", head_part)
            if request.startswith(b"HEAD ") or "text/event-stream" in head_part:
                return status, b""
            body = await (reader.readexactly(int(length[1])) if length else reader.read())
    finally:
        writer.close()
    return status, body


async def test_the_2026_one_request_attacks_are_refused_and_leave_nothing_held(llm: LLMEngine) -> None:
    async with serve(llm, api_keys=load_api_keys([KEY], None, None)) as server:
        host, port = server.test_server.host, server.test_server.port
        seen: list[tuple[str, int, bytes]] = []
        answered = 0
        for method, path, host_header in UNKEYED:
            status, body = await send(host, port, raw(method, path, host_header, COMPLETION))
            seen.append((f"{method} {path} Host={host_header}", status, body))
            assert status in (401, 404, 405), (method, path, host_header, status, body)
        for path, data in BODIES:
            status, body = await send(host, port, raw("POST", path, body=json.dumps(data).encode(), key=True))
            seen.append((path, status, body))
            assert status == 200 or 400 <= status < 500, (path, status, body[:300])
            answered += status == 200
            if status != 200 and path != "/v1/messages":
                assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, body[:300]
        for garbage in GARBAGE:
            status, body = await send(host, port, raw("POST", "/v1/completions", body=garbage, key=True))
            seen.append((repr(garbage[:20]), status, body))
            assert status == 400, (garbage[:40], status, body[:300])
        assert len(seen) == 32
        assert answered == 3  # (every option at once runs: with tools, with a schema; Anthropic's clamped stream)
        leaks = [(what, body[:200]) for what, _, body in seen if ADDRESS.search(body)]
        assert not leaks, leaks
        assert server.engine.alive
        # and it still answers
        status, body = await send(host, port, raw("POST", "/v1/completions", body=COMPLETION, key=True))
        assert status == 200, body
    # (serve's exit asserts the pool whole: no request running or waiting, no KV block held)
