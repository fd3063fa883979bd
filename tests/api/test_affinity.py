"""Session affinity (issue 46): every generation response echoes the request's id (x-request-id:
the client's own, else inferd's response id) and the session key the client named (x-session-id:
the header, else the body's prompt_cache_key), streaming or not, errors included, so that a
router in front can pin a session to a replica. A key inferd derived (Anthropic's cache_control)
is never echoed, and nothing unfit for a header (control characters, CR/LF, non-ASCII, too long)
is reflected: over a real socket, the raw response head is read back. Then deploy/haproxy.cfg,
rendered by deploy/fleet.sh, in front of two in-process replicas: a session stays on its replica
while requests without one (or with a blank one) spread, and moves when its replica goes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from apiserver import MODEL, Server, data_events, serve

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

REPO = Path(__file__).resolve().parents[2]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
RESPONSES = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "temperature": 0}
MESSAGES = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}


async def echoed(server: Server, path: str, body: dict[str, Any], stream: bool = False,
                 **headers: str) -> tuple[int, str | None, str | None, Any]:
    """(status, x-request-id, x-session-id, the reply's id: the body's, or the first event's)."""
    async with server.session.post(path, json={**body, "stream": stream}, headers=headers) as r:
        text = await r.text()
    if stream and r.status == 200:
        first = data_events([e for e in text.split("\n\n") if e])[0]
        reply_id = first.get("id") or first.get("message", first.get("response", {})).get("id")
    else:
        reply_id = json.loads(text).get("id")
    return r.status, r.headers.get("x-request-id"), r.headers.get("x-session-id"), reply_id


@pytest.mark.parametrize("stream", [False, True])
async def test_each_generation_path_echoes_its_ids(server: Server, stream: bool) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                       ("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES)):
        status, rid, session, reply_id = await echoed(server, path, body, stream)
        assert status == 200 and reply_id and rid == reply_id and session is None, (path, rid, session)
        status, rid, session, _ = await echoed(server, path, body, stream,
                                               **{"x-request-id": "trace-7", "x-session-id": " conv-42 "})
        assert (status, rid, session) == (200, "trace-7", "conv-42"), path  # (a header's spaces are no key)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/responses", RESPONSES)):  # the body's key
        status, _, session, _ = await echoed(server, path, {**body, "prompt_cache_key": "user-9/chat"}, stream)
        assert (status, session) == (200, "user-9/chat"), path
        status, _, session, _ = await echoed(server, path, {**body, "prompt_cache_key": "body"}, stream,
                                             **{"x-session-id": "header"})
        assert session == "header", path  # the key the session ran under


async def test_anthropic_derived_keys_stay_inside(server: Server) -> None:
    cached = {**MESSAGES, "system": [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}]}
    for body in (cached, {**cached, "metadata": {"user_id": "user_abc_session_42"}}):
        status, rid, session, reply_id = await echoed(server, "/v1/messages", body)
        assert status == 200 and rid == reply_id and session is None  # a session ran, under inferd's key
    status, _, session, _ = await echoed(server, "/v1/messages", cached, **{"x-session-id": "claude-1"})
    assert (status, session) == (200, "claude-1")


async def test_errors_echo_what_the_request_got_to(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inferd.requests")
    status, rid, session, _ = await echoed(server, "/v1/chat/completions", {**CHAT, "model": "no-such-model"},
                                           **{"x-request-id": "trace-404", "x-session-id": "s-1"})
    assert (status, rid, session) == (404, "trace-404", "s-1")
    status, rid, session, _ = await echoed(server, "/v1/completions", COMPLETION,
                                           **{"x-request-id": "trace-400", "x-session-id": "k" * 257})
    assert (status, rid, session) == (400, "trace-400", None)  # a refused key is no session
    status, rid, session, _ = await echoed(server, "/v1/chat/completions", {"model": MODEL})  # no inferd id yet
    assert (status, rid, session) == (400, None, None)
    logged = [r.fields for r in caplog.records if r.name == "inferd.requests"]  # type: ignore[attr-defined]
    assert [line.get("request_id") for line in logged] == ["trace-404", "trace-400", None]  # a trace finds its line


async def test_keys_unfit_for_a_header_are_used_but_never_reflected(server: Server) -> None:
    for key in ("a\r\nset-cookie: stolen=1", "tab\there", "café", "\x7f", "k" * 256):
        status, rid, session, reply_id = await echoed(server, "/v1/chat/completions", {**CHAT, "prompt_cache_key": key})
        expected = key if key == "k" * 256 else None  # (256 printable characters: a key, echoed whole)
        assert (status, rid, session) == (200, reply_id, expected), repr(key)


async def raw_head(server: Server, *lines: bytes) -> bytes:
    """A streaming chat request over a raw socket with extra header `lines`; the response head."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(server.test_server.host, server.test_server.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     + b"".join(line + b"\r\n" for line in lines)
                     + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        async with asyncio.timeout(30):
            response = await reader.read()
    finally:
        writer.close()
    return response.partition(b"\r\n\r\n")[0]


async def test_hostile_header_values_are_never_reflected(server: Server) -> None:
    fine = await raw_head(server, b"x-request-id: trace-raw", b"x-session-id: sess-raw")
    assert fine.startswith(b"HTTP/1.1 200") and b"\r\nx-request-id: trace-raw" in fine.lower()
    assert b"\r\nx-session-id: sess-raw" in fine.lower()
    for value in (b"ev\x01il", b"caf\xc3\xa9", b"obs\xfftext", b"tab\tin", b"t" * 129):
        session = b"x-session-id: " + value if len(value) < 129 else b"x-session-id: fine"  # (a 129-char key is fine)
        head = await raw_head(server, b"x-request-id: " + value, session)
        lines = head.lower().split(b"\r\n")
        assert not any(value.lower() in line for line in lines[1:]), head  # refused (400), or not echoed
        if head.startswith(b"HTTP/1.1 200"):  # let through: inferd's own id instead, no session echoed
            assert any(line.startswith(b"x-request-id: chatcmpl-") for line in lines), head
            assert not any(line.startswith(b"x-session-id") and b"fine" not in line for line in lines), head


# ------------------------------------------------------------------------- through HAProxy


@pytest_asyncio.fixture
async def balanced(llm: LLMEngine, served_weights: tuple, tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """deploy/haproxy.cfg, rendered by deploy/fleet.sh for two in-process replicas (one model's
    weights, two engines), on a free port: (its URL, its stats socket). The test's one addition
    names the replica that answered in a response header."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy; tests/e2e/test_fleet.py installs it as root)")
    second = LLMEngine(*served_weights, EngineConfig.of(kv_cache_memory=64 * 2**20))
    async with serve(llm) as r1, serve(second) as r2:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            bind = f"127.0.0.1:{s.getsockname()[1]}"
        addrs = [f"{r.test_server.host}:{r.test_server.port}" for r in (r1, r2)]
        rendered = subprocess.run(["bash", str(REPO / "deploy" / "fleet.sh"), "config", bind, *addrs],
                                  capture_output=True, text=True, check=True).stdout
        (tmp_path / "haproxy.cfg").write_text(rendered + "    http-response set-header x-test-replica %[srv_name]\n")
        stats = Path(tempfile.mkdtemp(prefix="lb")) / "stats.sock"  # (a unix socket's path: 107 bytes at most)
        proc = await asyncio.create_subprocess_exec(haproxy, "-db", "-f", str(tmp_path / "haproxy.cfg"),
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                                                    env={**os.environ, "INFERD_LB_STATS": str(stats)})
        try:
            yield f"http://{bind}", stats
        finally:
            proc.kill()
            await proc.wait()
            shutil.rmtree(stats.parent, ignore_errors=True)


async def test_haproxy_keeps_a_session_on_its_replica(balanced: tuple[str, Path]) -> None:
    url, stats = balanced
    async with aiohttp.ClientSession(base_url=url) as client:

        async def replica(session: str | None = None) -> str:
            headers = {"x-session-id": session} if session is not None else {}
            async with asyncio.timeout(30):
                while True:  # (until HAProxy listens)
                    try:
                        async with client.post("/v1/completions", json=COMPLETION, headers=headers) as r:
                            assert r.status == 200 and r.headers.get("x-session-id") == (session or None)
                            return r.headers["x-test-replica"]
                    except aiohttp.ClientConnectorError:
                        await asyncio.sleep(0.05)

        assert {await replica() for _ in range(4)} == {"r1", "r2"}  # no session: leastconn spreads them
        assert {await replica("") for _ in range(4)} == {"r1", "r2"}  # a blank one is none (no key "")
        keys = ["alice", "bob", "carol"]  # (an odd count, each round in another order: no pattern of
        home = {key: await replica(key) for key in keys}  # leastconn's alternation can match them all)
        for turn in range(3):
            for key in keys[turn:] + keys[:turn]:
                assert await replica(key) == home[key], key
        moved = "alice"
        reader, writer = await asyncio.open_unix_connection(str(stats))
        writer.write(f"disable server replicas/{home[moved]}\n".encode())  # (maintenance: as if down)
        await writer.drain()
        await reader.read()
        writer.close()
        away = await replica(moved)
        assert away != home[moved] and await replica(moved) == away  # redispatched, and kept there
