"""The HTTP edge as an attacker and an odd-but-legal client meet it, over raw sockets: a
credential header given twice, a declared body over the cap, HTTP/1.0 streams, a chunked body
that never ends, a request head sent a line at a time, an idle keep-alive connection."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from apiserver import MODEL, Server, serve

from inferd.api.edge import MAX_BODY_BYTES
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import Settings

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

KEYS = {"alpha": "sk-alpha", "beta": "sk-beta"}
SHORT = 1.0  # the body and idle timeouts of these servers, in seconds


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest_asyncio.fixture
async def edge_server(llm: LLMEngine) -> AsyncIterator[Server]:
    settings = Settings.model_validate({
        "server": {"body_timeout_seconds": SHORT, "idle_timeout_seconds": SHORT},
        "tenants": {name: {"key_sha256": [sha(key)]} for name, key in KEYS.items()},
    })
    async with serve(llm, settings) as s:
        yield s


async def connect(server: Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(server.test_server.host, server.test_server.port)


def completion(stream: bool = False) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()


def head(version: str, body: bytes, *lines: str, path: str = "/v1/completions") -> bytes:
    fields = "".join(f"{line}\r\n" for line in lines)
    return (f"POST {path} HTTP/{version}\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{fields}\r\n").encode()


async def answer(reader: asyncio.StreamReader, within: float) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body (its Content-Length, else until the server closes), within
    `within` seconds. (After a refusal the server still reads what the client sends, for a
    while, before it closes: a response is not lost to a reset while the client is sending.)"""
    async with asyncio.timeout(within):
        head_part = (await reader.readuntil(b"\r\n\r\n"))[:-4]
        status_line, *header_lines = head_part.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        else:
            body = await reader.read()
    return int(status_line.split()[1]), headers, body


async def refusals(server: Server) -> dict[str, float]:
    async with server.session.get("/metrics") as r:
        text = await r.text()
    prefix = "inferd_http_refusals_total{reason=\""
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith(prefix)}


async def test_a_credential_header_given_twice_is_a_400(edge_server: Server) -> None:
    # tenant alpha's key, then tenant beta's: served as neither
    for name in ("Authorization", "x-api-key"):
        reader, writer = await connect(edge_server)
        body = completion()
        writer.write(head("1.1", body, f"{name}: Bearer {KEYS['alpha']}", f"{name}: Bearer {KEYS['beta']}") + body)
        status, headers, rest = await answer(reader, 5)
        writer.close()
        error = json.loads(rest)["error"]
        assert status == 400 and error["code"] == "duplicate_header" and name in error["message"], rest
        assert headers["connection"] == "close"
    assert (await refusals(edge_server))["duplicate_header"] == 2


async def test_one_key_is_still_served(edge_server: Server) -> None:
    reader, writer = await connect(edge_server)
    body = completion()
    writer.write(head("1.1", body, f"Authorization: Bearer {KEYS['beta']}", "Connection: close") + body)
    status, _, rest = await answer(reader, 30)
    writer.close()
    assert status == 200, rest


async def test_a_declared_body_over_the_cap_is_a_413_from_the_header(edge_server: Server) -> None:
    reader, writer = await connect(edge_server)
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEYS['alpha']}\r\nContent-Length: {2 * MAX_BODY_BYTES}\r\n\r\n".encode())
    started = time.monotonic()
    status, headers, rest = await answer(reader, 5)  # (no byte of the body was sent)
    writer.close()
    assert status == 413 and json.loads(rest)["error"]["code"] == "body_too_large", rest
    assert time.monotonic() - started < SHORT  # from the header, not after a body timeout
    assert (await refusals(edge_server))["body_too_large"] == 1


async def test_http_1_0_streams_end_with_the_connection_not_chunked(edge_server: Server) -> None:
    reader, writer = await connect(edge_server)
    body = completion(stream=True)
    writer.write(head("1.0", body, f"Authorization: Bearer {KEYS['alpha']}") + body)
    status, headers, rest = await answer(reader, 30)
    writer.close()
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), rest
    assert "transfer-encoding" not in headers and "content-length" not in headers
    events = [e for e in rest.decode().split("\n\n") if e]
    assert events[-1].endswith("data: [DONE]") and len(events) >= 4, events
    texts = [json.loads(e.split("data: ", 1)[1])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts)


async def test_a_resumable_stream_resumes_over_http_1_0(edge_server: Server) -> None:
    reader, writer = await connect(edge_server)
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                       "stream": True, "resumable": True}).encode()
    writer.write(head("1.0", body, f"Authorization: Bearer {KEYS['alpha']}") + body)
    status_and_headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    first = await asyncio.wait_for(reader.readuntil(b"\n\n"), 30)
    writer.close()  # gone after its first event: the stream runs on, detached
    assert status_and_headers.startswith(b"HTTP/1.0 200") and b"chunked" not in status_and_headers.lower()
    event_id = first.decode().split("id: ", 1)[1].split("\n", 1)[0]
    stream_id = event_id.rsplit(":", 1)[0]
    reader, writer = await connect(edge_server)
    writer.write(f"GET /v1/streams/{stream_id} HTTP/1.0\r\nHost: localhost\r\nLast-Event-ID: {event_id}\r\n"
                 f"Authorization: Bearer {KEYS['alpha']}\r\n\r\n".encode())
    status, headers, rest = await answer(reader, 30)
    writer.close()
    assert status == 200 and "transfer-encoding" not in headers, rest
    assert rest.decode().rstrip().endswith("data: [DONE]") and rest.count(b"data: ") >= 2, rest


async def test_a_chunked_body_that_never_ends_is_a_408(edge_server: Server) -> None:
    reader, writer = await connect(edge_server)
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEYS['alpha']}\r\nTransfer-Encoding: chunked\r\n\r\n"
                 "5\r\n{\"mod\r\n".encode())  # and nothing more
    started = time.monotonic()
    status, _, rest = await answer(reader, 10 * SHORT)
    writer.close()
    assert status == 408 and json.loads(rest)["error"]["code"] == "body_timeout", rest
    assert SHORT <= time.monotonic() - started < 5 * SHORT
    assert (await refusals(edge_server))["body_timeout"] == 1


async def test_a_head_sent_a_line_at_a_time_is_cut(edge_server: Server) -> None:
    reader, writer = await connect(edge_server)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    started = time.monotonic()
    closed = None
    for i in range(int(20 * SHORT / 0.25)):  # a header line every 0.25 s, for up to 20 timeouts
        try:
            writer.write(f"X-Slow-{i}: x\r\n".encode())
            await writer.drain()
        except ConnectionError:
            closed = time.monotonic()
            break
        if reader.at_eof() or (await _closed_within(reader, 0.25)):
            closed = time.monotonic()
            break
    writer.close()
    assert closed is not None and closed - started < 5 * SHORT, "the slow head held its connection"


async def test_an_idle_keep_alive_connection_is_closed(edge_server: Server) -> None:
    reader, writer = await connect(edge_server)
    writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert first.startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    assert await _closed_within(reader, 10 * SHORT), "the idle connection stayed open"
    assert SHORT * 0.5 <= time.monotonic() - started < 5 * SHORT
    writer.close()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (what it sends is dropped)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            if not await asyncio.wait_for(reader.read(65536), left):
                return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True
    return False


async def test_a_lone_surrogate_escape_is_a_400_not_a_500(edge_server: Server) -> None:
    # legal JSON, not Unicode text: it reached the tokenizer (a TypeError there: a 500)
    for body in ('{"model": "smollm2", "prompt": "Hi \\ud800 there", "max_tokens": 2}',
                 '{"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "\\udfff"}]}'):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        async with edge_server.session.post(path, data=body, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {KEYS['alpha']}"}) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and "surrogate" in error["message"], error
    status, reply = await edge_server.post("/v1/completions", {"model": MODEL, "prompt": "Hi \U0001F600",
                                                               "max_tokens": 2},
                                           headers={"Authorization": f"Bearer {KEYS['alpha']}"})
    assert status == 200, reply  # (a pair, escaped or not, is one character)
