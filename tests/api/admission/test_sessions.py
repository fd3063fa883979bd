"""Sessions (issue 43): the key a request names (x-session-id > prompt_cache_key > Anthropic's
cache_control-derived key), checked, scoped to its tenant at the door, its TTL the one asked or
the server's, capped, its priority the class's rank; and through a real server, the
EngineRequest.session each generation path hands the engine (none for pooling requests)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import make_mocked_request
from apiserver import MODEL, Server, assert_error, serve

from inferd.api.admission.ask import SessionAsk
from inferd.api.admission.door import FrontDoor, class_rank
from inferd.api.anthropic.cache import asked_ttl, cache_controls, conversation_key, session_of
from inferd.api.anthropic.wire import MessagesRequest
from inferd.api.errors import APIError
from inferd.api.gateway.tenants import Tenant
from inferd.api.pipeline.sessions import asked_session
from inferd.api.state import ServerState
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.protocol import EngineRequest, Session
from inferd.settings.config import CacheSettings, LimitSettings, Settings
from inferd.settings.policy import PriorityClass, SchedulingPolicy


def request(headers: dict[str, str] | None = None) -> Any:
    return make_mocked_request("POST", "/v1/chat/completions", headers=headers or {})


def refused(call: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as e:
        call(*args)
    assert e.value.status == 400
    return e.value


# ---------------------------------------------------------------------------- the keys


def test_the_header_wins_over_the_body_key_and_keys_are_checked() -> None:
    assert asked_session(request()) is None
    assert asked_session(request(), "conv-1") == SessionAsk("conv-1")
    assert asked_session(request({"x-session-id": "hdr"}), "conv-1") == SessionAsk("hdr")
    assert asked_session(request({"x-session-id": "  "}), "conv-1") == SessionAsk("conv-1")  # blank: no header
    assert asked_session(request({"x-session-id": "hdr"}), None, ttl=60) == SessionAsk("hdr", 60)
    assert asked_session(request(), "k" * 256) == SessionAsk("k" * 256)
    assert refused(asked_session, request(), "k" * 257).param == "prompt_cache_key"
    assert refused(asked_session, request(), "").param == "prompt_cache_key"
    assert refused(asked_session, request({"x-session-id": "h" * 257}), "ok").param == "x-session-id"


def messages(**fields: Any) -> MessagesRequest:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}
    return MessagesRequest.model_validate(body)


def test_any_cache_control_asks_for_a_session_with_the_largest_ttl() -> None:
    assert cache_controls(messages()) == []
    ephemeral = {"type": "ephemeral"}
    body = messages(system=[{"type": "text", "text": "sys", "cache_control": {**ephemeral, "ttl": "5m"}}],
                    tools=[{"name": "t", "input_schema": {"type": "object"}, "cache_control": {**ephemeral, "ttl": "1h"}}],
                    messages=[{"role": "user", "content": [
                        {"type": "text", "text": "a", "cache_control": ephemeral},
                        {"type": "tool_result", "tool_use_id": "x", "content": [
                            {"type": "text", "text": "r", "cache_control": {**ephemeral, "ttl": "30s"}}]}]}])
    controls = cache_controls(body)
    assert len(controls) == 4 and asked_ttl(controls) == 3600
    assert asked_ttl(cache_controls(messages(cache_control=ephemeral))) is None  # (the server's TTL)
    for bad in ("forever", "5", "0m", 5, "1d"):
        err = refused(asked_ttl, [{"type": "ephemeral", "ttl": bad}])
        assert err.param == "cache_control" and repr(bad) in err.message


def test_anthropic_keys_come_from_the_header_the_user_id_or_the_conversation() -> None:
    cached = messages(cache_control={"type": "ephemeral"})
    assert session_of(request(), messages(), [], None) is None  # no cache_control: no session
    assert session_of(request({"x-session-id": "h"}), messages(), [], None) == SessionAsk("h")
    assert session_of(request({"x-session-id": "h"}), cached, [{"ttl": "1h"}], "u") == SessionAsk("h", 3600)
    assert session_of(request(), cached, [{}], "user_1_session_2") == SessionAsk("user_1_session_2")
    long_id = "u" * 300
    assert conversation_key(cached, long_id) == hashlib.sha256(long_id.encode()).hexdigest()
    # the first turn, then a later one: the same system and first message, breakpoints moved
    first = messages(system="You are terse.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}])
    later = messages(system="You are terse.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}]}])
    key = conversation_key(first, None)
    assert key.startswith("conversation:") and key == conversation_key(later, None)
    assert key != conversation_key(messages(system="You are verbose.", messages=first.model_dump()["messages"]), None)


# ---------------------------------------------------------------------------- the door


def test_class_rank_puts_the_more_important_class_higher() -> None:
    policy = SchedulingPolicy(classes=(PriorityClass("batch", 5), PriorityClass("interactive", 0),
                                       PriorityClass("bulk", 9)), default_class="interactive")
    assert [class_rank(policy, c) for c in policy.classes] == [1, 2, 0]


def test_the_door_scopes_the_key_and_settles_the_ttl(llm: LLMEngine) -> None:
    cache = CacheSettings(session_ttl_seconds=300, session_max_ttl_seconds=1800)
    door = FrontDoor(AsyncEngine(llm), ServerState("m"), LimitSettings(), cache=cache)
    policy = door.limits.policy
    interactive, batch = policy.lookup("interactive"), policy.lookup("batch")
    acme = Tenant.from_settings("acme", Settings.model_validate({"tenants": {"acme": {}}}).tenants["acme"])
    assert door.session(None, interactive, acme) is None
    assert door.session(SessionAsk("k"), interactive, None) == Session("\x00k", 300, 1)
    assert door.session(SessionAsk("k", 600), batch, acme) == Session("acme\x00k", 600, 0)
    assert door.session(SessionAsk("k", 60), batch, acme).ttl == 60  # a shorter one, as asked
    assert door.session(SessionAsk("k", 7200), batch, acme).ttl == 1800  # capped


# ---------------------------------------------------------------------- through a server


def record_submissions(server: Server, monkeypatch: pytest.MonkeyPatch) -> list[EngineRequest]:
    """Every EngineRequest the door hands the engine, in order (what the engine does with a
    session, engine/kv/retention.py, is tests/engine's to check; here it is what the door built)."""
    seen: list[EngineRequest] = []
    submit = server.engine.submit

    def recording(request: EngineRequest, *args: Any, **kwargs: Any) -> Any:
        seen.append(request)
        return submit(request, *args, **kwargs)

    monkeypatch.setattr(server.engine, "submit", recording)
    return seen


@pytest.fixture
def submitted(server: Server, monkeypatch: pytest.MonkeyPatch) -> list[EngineRequest]:
    return record_submissions(server, monkeypatch)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
RESPONSES = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "temperature": 0}
MESSAGES = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.asyncio
@pytest.mark.served
async def test_each_generation_path_hands_the_engine_its_session(server: Server,
                                                                 submitted: list[EngineRequest]) -> None:
    async def session(path: str, body: dict[str, Any], **headers: str) -> Session | None:
        status, reply = await server.post(path, body, headers=headers)
        assert status == 200, reply
        return submitted[-1].session

    assert await session("/v1/chat/completions", CHAT) is None
    assert await session("/v1/chat/completions", {**CHAT, "prompt_cache_key": "c1"}) == Session("\x00c1", 300, 1)
    hdr = await session("/v1/chat/completions", {**CHAT, "prompt_cache_key": "c1"}, **{"x-session-id": "h1"})
    assert hdr == Session("\x00h1", 300, 1)
    batch = await session("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": "batch"},
                          **{"x-session-id": "h2"})
    assert batch == Session("\x00h2", 300, 0)
    assert await session("/v1/responses", {**RESPONSES, "prompt_cache_key": "r1"}) == Session("\x00r1", 300, 1)
    assert await session("/v1/messages", MESSAGES) is None  # no cache_control, no header
    claude = {**MESSAGES, "metadata": {"user_id": "user_abc_session_42"},
              "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}
    assert await session("/v1/messages", claude) == Session("\x00user_abc_session_42", 3600, 1)
    assert await session("/v1/messages", claude, **{"x-session-id": "h3"}) == Session("\x00h3", 3600, 1)
    derived = await session("/v1/messages", {**claude, "metadata": {}})
    assert derived is not None and derived.key.startswith("\x00conversation:")
    count = len(submitted)
    status, _ = await server.post("/v1/embeddings", {"model": MODEL, "input": "Hi"}, headers={"x-session-id": "e"})
    assert status == 200 and all(r.session is None for r in submitted[count:])  # pooling: no session


@pytest.mark.asyncio
@pytest.mark.served
async def test_bad_keys_and_ttls_are_400s_in_each_protocols_shape(server: Server,
                                                                 submitted: list[EngineRequest]) -> None:
    status, body = await server.post("/v1/chat/completions", {**CHAT, "prompt_cache_key": "k" * 257})
    assert_error(status, body, 400, param="prompt_cache_key")
    status, body = await server.post("/v1/responses", {**RESPONSES, "prompt_cache_key": "k" * 257})
    assert_error(status, body, 400, param="prompt_cache_key")
    status, body = await server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                                     headers={"x-session-id": "h" * 257})
    assert_error(status, body, 400, param="x-session-id")
    status, body = await server.post("/v1/messages", {**MESSAGES, "cache_control": {"type": "ephemeral",
                                                                                     "ttl": "a while"}})
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "cache_control" in body["error"]["message"] and "'a while'" in body["error"]["message"]
    assert submitted == []  # nothing reached the engine


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest_asyncio.fixture
async def tenants_server(llm: LLMEngine) -> AsyncIterator[Server]:
    settings = Settings.model_validate({
        "tenants": {name: {"key_sha256": [sha(f"sk-{name}")]} for name in ("alpha", "beta")},
        "cache": {"session_ttl_seconds": 120, "session_max_ttl_seconds": 600}})
    async with serve(llm, settings) as s:
        yield s


@pytest.mark.asyncio
@pytest.mark.served
async def test_two_tenants_equal_keys_never_meet(tenants_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = record_submissions(tenants_server, monkeypatch)
    for tenant in ("alpha", "beta"):
        status, _ = await tenants_server.post("/v1/chat/completions", {**CHAT, "prompt_cache_key": "shared"},
                                              headers={"Authorization": f"Bearer sk-{tenant}"})
        assert status == 200
    status, _ = await tenants_server.post("/v1/messages", {**MESSAGES, "cache_control": {"type": "ephemeral",
                                                                                          "ttl": "1h"}},
                                          headers={"x-api-key": "sk-alpha", "x-session-id": "shared"})
    assert status == 200
    assert [r.session for r in seen] == [Session("alpha\x00shared", 120, 1), Session("beta\x00shared", 120, 1),
                                         Session("alpha\x00shared", 600, 1)]  # (1h asked, capped at 600 s)


@pytest.mark.asyncio
@pytest.mark.served
async def test_a_sessions_prefix_is_held_and_counted(server: Server) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "Count the sheep. " * 24}], "prompt_cache_key": "held"}
    status, _ = await server.post("/v1/chat/completions", body)
    assert status == 200
    status, again = await server.post("/v1/chat/completions", body)
    assert status == 200
    usage = again["usage"]
    assert usage["prompt_cache"]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["prompt_cache"]["miss"] is None  # all of the session's state came back
    status, state = await server.get("/v1/status")
    assert status == 200 and state["cache_tiers"]["sessions"] >= 1 and state["cache_tiers"]["session_blocks"] >= 1
    assert state["cache_tiers"]["host_blocks_total"] == 0  # (a CPU-only box: no host tier by default)
    async with server.session.get("/metrics") as reply:
        text = await reply.text()
    assert "inferd_cache_sessions " in text and "inferd_host_cache_hits_total 0.0" in text
