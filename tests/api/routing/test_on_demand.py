"""Models on demand, unloads, sleep and wake, over real HTTP (routing/lifecycle.py, holds.py): two
models loaded on their first request taking turns under models_max = 1 (every request answered,
the switches counted, one load for two racing requests, the KV pools whole), an idle model
unloaded and a pinned one kept, sleep at levels 1 and 2 and wake while a stream, tokenize calls
and waiting requests race them, a bad model file found only on demand (422, the server serves
on), and the admin endpoints' key. Every engine here is the session's SmolLM2 weights under
another name, so a "load" costs a KV cache and a probe, not a GGUF read (but the bad file's)."""

from __future__ import annotations

import asyncio
import hashlib
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from apiserver import Server, assert_error, data_events, serve

from inferd.api.routing.registry import REGISTRY, ModelRegistry, load_models
from inferd.api.routing.served import ModelSpec
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.model.loading.loader import default_model_path
from inferd.settings.config import Settings

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

ADMIN_KEY, USER_KEY = "admin-secret-key", "user-secret-key"
KV = 32 * 2**20


class Loader:
    """Loads a model as `inferd serve` would: a file from its path (a bad one fails), the embedded
    model as an engine over the session's weights. Keeps every core it made (for the pools' check)."""

    def __init__(self, weights: tuple[Any, Any]) -> None:
        self.weights = weights
        self.cores: list[LLMEngine] = []
        self.calls: list[str] = []

    def __call__(self, spec: ModelSpec) -> AsyncEngine:
        self.calls.append(spec.name)
        config = EngineConfig.of(kv_cache_memory=KV, model=spec.path)
        core = LLMEngine.from_config(config) if spec.path else LLMEngine(*self.weights, config)
        self.cores.append(core)
        return AsyncEngine(core)

    def assert_pools_whole(self) -> None:
        for core in self.cores:
            if hasattr(core, "kv_cache"):  # (not asleep at level 1)
                core.block_manager.check_invariants()
                assert core.block_manager.num_used_blocks == 0


def settings_of(models: dict[str, Any], **server: Any) -> Settings:
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    return Settings.model_validate({
        "server": {"probe_interval_seconds": 0, "admin_key_sha256": [digest], "model_load_wait_seconds": 30, **server},
        "models": models,
    })


@asynccontextmanager
async def serve_fleet(settings: Settings, loader: Loader) -> AsyncIterator[Server]:
    fleet = load_models(settings, loader)
    user = hashlib.sha256(USER_KEY.encode()).hexdigest()
    async with serve(fleet, settings, api_keys=frozenset({user})) as s:
        s.session.headers["Authorization"] = f"Bearer {USER_KEY}"
        yield s
    loader.assert_pools_whole()


def fleet_of(server: Server) -> ModelRegistry:
    return server.test_server.app[REGISTRY]


async def complete(server: Server, model: str, max_tokens: int = 2, **extra: Any) -> tuple[int, Any, Any]:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0,
            **extra}
    async with server.session.post("/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None), r.headers


async def stream_text(server: Server, model: str, max_tokens: int) -> tuple[int, int]:
    """(status, completion tokens) of a whole stream."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with server.session.post("/v1/completions", json=body) as r:
        text = await r.text()
    usages = [e["usage"] for e in data_events([e for e in text.split("\n\n") if e]) if e.get("usage")]
    return r.status, usages[-1]["completion_tokens"] if usages else 0


async def admin(server: Server, path: str, body: Any = None, key: str = ADMIN_KEY) -> tuple[int, Any]:
    async with server.session.post(path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json(content_type=None)


async def model_states(server: Server) -> dict[str, dict[str, Any]]:
    status, body = await server.get("/v1/status")
    assert status == 200, body
    return {m["name"]: m for m in body["models"]}


async def until(predicate: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_two_models_on_demand_take_turns_under_models_max_1(served_weights: tuple) -> None:
    loader = Loader(served_weights)
    settings = settings_of({"a": {"load": "on_demand"}, "b": {"load": "on_demand"}}, models_max=1)
    async with serve_fleet(settings, loader) as server:
        fleet = fleet_of(server)
        status, listing = await server.get("/v1/models")  # ready with nothing loaded; both listed
        assert status == 200 and {c["id"]: c["state"] for c in listing["data"]} == {"a": "unloaded", "b": "unloaded"}
        assert (await server.get("/ready"))[0] == 200 and (await server.get("/v1/status"))[1]["kv_blocks_total"] == 0
        # two racing requests for one model: one load, both answered
        answers = await asyncio.gather(complete(server, "a"), complete(server, "a"))
        assert [a[0] for a in answers] == [200, 200] and loader.calls == ["a"]
        # alternating, and a stream on one while the other is asked for: it waits for the stream
        for model in ("b", "a", "b"):
            status, body, headers = await complete(server, model)
            assert (status, headers["x-inferd-model"]) == (200, f"{model}@1"), body
        stream = asyncio.ensure_future(stream_text(server, "b", 24))
        await until(lambda: fleet.slots["b"].current.engine.open_requests == 1, 5)
        tokenized = asyncio.ensure_future(server.post("/tokenize", {"model": "b", "prompt": "hello " * 20000}))
        switched = await complete(server, "a")  # (b unloads for it once its stream and tokenize call are done)
        assert await stream == (200, 24) and switched[0] == 200, switched
        status, body = await tokenized
        assert status == 200 and body["count"] >= 20000
        models = await model_states(server)
        assert (models["a"]["state"], models["b"]["state"]) == ("serving", "unloaded")
        a, b = models["a"]["life"], models["b"]["life"]
        assert (a["loads"], b["loads"], a["switches"] + b["switches"], a["unloads"] + b["unloads"]) == (3, 2, 4, 4)
        assert a["load_waits"] >= 3 and a["load_wait_timeouts"] == 0
        assert sum(1 for s in fleet.slots.values() if s.current is not None) == 1
        async with server.session.get("/metrics") as r:
            text = await r.text()
        assert 'inferd_model_state{model="b",state="unloaded"} 1.0' in text
        assert 'inferd_model_switches_total{model="a"} 2.0' in text and 'inferd_model_loads_total{model="b"} 2.0' in text
    assert len(loader.cores) == 5


async def test_an_idle_model_unloads_after_its_timeout_and_a_pinned_one_never(served_weights: tuple) -> None:
    loader = Loader(served_weights)
    settings = settings_of({"idle": {"load": "on_demand", "idle_unload_seconds": 0.3},
                            "kept": {"load": "on_demand", "pinned": True, "idle_unload_seconds": 0.3}})
    async with serve_fleet(settings, loader) as server:
        fleet = fleet_of(server)
        for model in ("idle", "kept"):
            assert (await complete(server, model))[0] == 200
        await until(lambda: fleet.slots["idle"].current is None, 5)
        await asyncio.sleep(0.5)  # (past the pinned one's timeout too)
        models = await model_states(server)
        assert (models["idle"]["state"], models["idle"]["life"]["unloads"]) == ("unloaded", 1)
        assert (models["kept"]["state"], models["kept"]["life"]["unloads"]) == ("serving", 0)
        assert (await complete(server, "idle"))[0] == 200  # loaded again on its next request
        assert loader.calls == ["idle", "kept", "idle"]


async def test_sleep_and_wake_while_a_stream_tokenize_calls_and_requests_race_them(served_weights: tuple) -> None:
    loader = Loader(served_weights)
    settings = settings_of({"a": {}, "b": {}})
    async with serve_fleet(settings, loader) as server:
        fleet = fleet_of(server)
        core = fleet.slots["a"].current.engine._engine  # (behind the face: its KV cache's storage)
        storage = weakref.ref(core.kv_cache.storage)
        del core
        # level 1 while a stream and tokenize calls run: they finish first, whole
        stream = asyncio.ensure_future(stream_text(server, "a", 32))
        await until(lambda: fleet.slots["a"].current.engine.open_requests == 1, 5)
        tokenize = [asyncio.ensure_future(server.post("/tokenize", {"model": "a", "prompt": "hello " * 2000}))
                    for _ in range(4)]
        slept = asyncio.ensure_future(admin(server, "/admin/models/a/sleep", {"level": 1}))
        assert await stream == (200, 32)
        status, body = await slept
        assert (status, body["state"], body["level"]) == (200, "asleep", 1) and body["kv_cache_bytes_freed"] > 0
        assert storage() is None  # the KV cache's memory went (at once: no cycle held it); the weights stay
        # requests meanwhile wait, and are answered once it wakes; the other model serves on
        waiting = [asyncio.ensure_future(complete(server, "a")) for _ in range(3)]
        assert (await complete(server, "b"))[0] == 200
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waiting) and (await model_states(server))["a"]["state"] == "asleep"
        status, body = await admin(server, "/admin/models/a/wake")
        assert (status, body["state"]) == (200, "serving"), body
        assert [(await w)[0] for w in waiting] == [200, 200, 200]
        assert [(await t)[0] for t in tokenize] == [200] * 4
        # level 2: the weights go too; a request waiting past model_load_wait_seconds gets 503 + Retry-After
        assert (await admin(server, "/admin/models/a/sleep", {"level": 2}))[1]["level"] == 2
        assert fleet.slots["a"].current is None
        fleet.load_wait_seconds = 0.2
        status, body, headers = await complete(server, "a")
        assert_error(status, body, 503, param="model", code="model_asleep")
        assert int(headers["Retry-After"]) >= 1
        fleet.load_wait_seconds = 30
        late = asyncio.ensure_future(complete(server, "a"))
        status, body = await admin(server, "/admin/models/a/wake")
        assert (status, body["state"], (await late)[0]) == (200, "serving", 200)
        life = (await model_states(server))["a"]["life"]
        assert (life["sleeps"], life["wakes"], life["load_wait_timeouts"]) == (2, 2, 1)
        assert loader.calls == ["a", "b", "a"]  # (level 1 woke over the same weights; level 2 loaded again)


async def test_a_bad_model_file_on_demand_is_a_422_and_the_server_serves_on(served_weights: tuple,
                                                                           tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        bad.write_bytes(f.read(1 << 20))  # (its header and the start of its tensors: the rest is missing)
    loader = Loader(served_weights)
    settings = settings_of({"good": {}, "bad": {"load": "on_demand", "path": str(bad)}})
    async with serve_fleet(settings, loader) as server:
        for _ in range(2):  # (a later request tries again)
            status, body, _ = await complete(server, "bad")
            assert_error(status, body, 422, param="model", code="model_load_failed")
            assert "bad" in body["error"]["message"]
            assert (await complete(server, "good"))[0] == 200
        assert (await server.get("/ready"))[0] == 200
        models = await model_states(server)
        assert (models["bad"]["state"], models["bad"]["life"]["load_failures"]) == ("failed", 2)
        assert models["bad"]["life"]["load_error"]
        status, body = await admin(server, "/admin/models/bad/wake")
        assert_error(status, body, 422, code="model_load_failed")


async def test_sleep_and_wake_need_an_admin_key_a_model_and_a_level(served_weights: tuple) -> None:
    loader = Loader(served_weights)
    async with serve_fleet(settings_of({"a": {}}), loader) as server:
        for path in ("/admin/models/a/sleep", "/admin/models/a/wake"):
            status, body = await admin(server, path, key=USER_KEY)
            assert_error(status, body, 403, code="admin_key_required")
        assert_error(*await admin(server, "/admin/models/nope/sleep"), 404, code="model_not_found")
        assert_error(*await admin(server, "/admin/models/a/sleep", {"level": 3}), 400, param="level")
        assert (await admin(server, "/admin/models/a/wake"))[1]["state"] == "serving"  # (awake: nothing to do)
        assert (await complete(server, "a"))[0] == 200
