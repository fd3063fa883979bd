"""A real server on a real socket for the API tests (imported by conftest.py and the tests)."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from inferd.api.app import create_app
from inferd.api.edge import connection_options
from inferd.api.admission.door import FrontDoor
from inferd.api.routing.registry import REGISTRY, ModelRegistry, single_model
from inferd.api.state import STATE, ServerState
from inferd.api.gateway.tenants import Keyring
from inferd.settings.config import Settings
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.llm_engine import LLMEngine

MODEL = "smollm2"
# the weights -> {deterministic mode: the start-up probe's tokens}, recorded by the first server
# over those weights: later servers over them start probed, as the tokens are the same (weak
# keys: a model loaded for one test leaves with it, and its id() can never name another's)
_PROBE_TOKENS: weakref.WeakKeyDictionary[Any, dict[bool, list[int]]] = weakref.WeakKeyDictionary()


@dataclass
class Server:
    engine: AsyncEngine  # its public face only: limits, snapshot, tokenizer, alive
    door: FrontDoor
    session: aiohttp.ClientSession
    test_server: TestServer

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
        async with self.session.post(path, json=body, **kwargs) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.session.get(path, **kwargs) as r:
            return r.status, await r.json(content_type=None)

    async def stream(self, path: str, body: Any, **kwargs: Any) -> tuple[aiohttp.ClientResponse, list[str]]:
        """POST with stream=true; the response and its raw body split into events."""
        async with self.session.post(path, json={**body, "stream": True}, **kwargs) as r:
            text = await r.text()
        return r, [e for e in text.split("\n\n") if e]


def data_events(events: list[str]) -> list[Any]:
    """The JSON payloads of `id: N\\ndata: ...` events ([DONE] excluded)."""
    out = []
    for event in events:
        data = next(line[6:] for line in event.split("\n") if line.startswith("data: "))
        if data != "[DONE]":
            out.append(json.loads(data))
    return out


@asynccontextmanager
async def serve(llm: LLMEngine | ModelRegistry, settings: Settings | None = None, api_keys: frozenset[str] = frozenset(),
                reload_keys: Callable[[], Keyring] | None = None) -> AsyncIterator[Server]:
    """A server over one model, or over a registry of several (Server.engine is then the first's)."""
    settings = settings or Settings()
    if settings.model.name is None:
        settings = settings.model_copy(update={"model": settings.model.model_copy(update={"name": MODEL})})
    registry = llm if isinstance(llm, ModelRegistry) else single_model(AsyncEngine(llm), settings)
    app = create_app(registry, settings, api_keys, reload_keys)
    primary = app[REGISTRY].primary.current  # (the first model's revision at start-up; None: it loads on demand)
    for served in app[REGISTRY].served():
        recorded = _PROBE_TOKENS.get(_weights(served.engine), {}).get(_deterministic(served.engine))
        if recorded is not None:
            served.probe.expected = recorded  # (the periodic probes still compare against it)
    test_server = TestServer(app)
    await test_server.start_server(**connection_options(settings.server))
    try:
        async with aiohttp.ClientSession(base_url=test_server.make_url("")) as session:
            await wait_ready(app[STATE])
            for served in app[REGISTRY].served():
                if served.probe.expected is not None:
                    tokens = _PROBE_TOKENS.setdefault(_weights(served.engine), {})
                    tokens.setdefault(_deterministic(served.engine), served.probe.expected)
            yield Server(primary.engine if primary else None, primary.door if primary else None,  # type: ignore[arg-type]
                         session, test_server)
        for served in app[REGISTRY].served():
            if served.engine.alive:  # (a test may have stopped it)
                await assert_pool_whole(served.engine, served.door)
    finally:
        await test_server.close()


def _weights(engine: AsyncEngine) -> Any:
    return engine._engine.model  # (a test's look behind the face: which weights it computes with)


def _deterministic(engine: AsyncEngine) -> bool:
    return engine._engine.config.model.deterministic


async def wait_ready(state: ServerState, within: float = 30.0) -> None:
    """Until the start-up inference probe has run (/ready would say 200), as a load balancer waits."""
    deadline = time.monotonic() + within
    while not state.probed:
        assert time.monotonic() < deadline, "the server never became ready"
        await asyncio.sleep(0.02)


async def assert_pool_whole(engine: AsyncEngine, door: FrontDoor, within: float = 10.0) -> None:
    """After a test: once its requests have ended (or been aborted as their clients left), the
    published snapshot shows no request and no KV block held (cached prefix blocks are
    evictable), and the door's queues count no request."""
    deadline = time.monotonic() + within

    def busy() -> tuple[int, int, int, int]:
        s = engine.snapshot
        return s.running, s.waiting, s.kv_blocks_used, engine.open_requests

    while any(busy()):
        assert time.monotonic() < deadline, busy()
        await asyncio.sleep(0.02)
    for cls in engine.limits.policy.classes:
        assert door.queues.queued(cls.name) == (0, 0), cls.name


def assert_error(status: int, body: Any, expected_status: int, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    expected_type = "invalid_request_error" if expected_status < 500 else error["type"]
    if expected_status == 401:
        expected_type = "authentication_error"
    if expected_status == 403:
        expected_type = "permission_error"
    if expected_status == 429:
        expected_type = "rate_limit_error"
    if type_ is not None:
        expected_type = type_
    assert error["type"] == expected_type, error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
