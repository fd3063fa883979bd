"""Several models in one process, over real HTTP: the default GGUF twice (two names, two
revisions) and a tiny random Llama folder as the small fallback. Routing by name, alias and
route (a 90/10 split, sticky per user), degradation on a failed probe and back, a cascade,
versioned reloads under load (no stream cut, the old revision freed), bad revisions refused.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import gc
import json
import sys
import weakref
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from apiserver import Server, assert_error, data_events, serve

from inferd.api.routing.degradation import FunctionalDegradation, ModelDegradation, Triggers
from inferd.api.routing.registry import REGISTRY, ModelRegistry, load_models
from inferd.api.routing.served import ModelSpec
from inferd.settings.config import Settings
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "model"))
import tiny_models  # noqa: E402  (tests/model's builders of tiny checkpoints)

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

ADMIN_KEY, USER_KEY = "admin-secret-key", "user-secret-key"
KV = 48 * 2**20


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = tiny_models.train_sentencepiece(folder)
    tiny_models.tiny_llama(vocab, seed=1).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def big2_weights(served_weights: tuple) -> Any:
    """big2's own copy of the weights, for the module (a test flips one of its weights, and puts it back)."""
    return copy.deepcopy(served_weights[0])


def loader(llm: LLMEngine, big2_weights: Any) -> Any:
    """big shares the session's weights, big2 has its copy; anything with a path is loaded from
    it, as `inferd serve` does, the first time this server loads that path. A path loaded again (a
    reload whose spec keeps the path, a rollback to it) gets a fresh copy of what the file gave:
    weights and an engine of its own, as a load gives, without the seconds of a GGUF load (three of
    them in the reload test, whose first load, the revision checked to be freed, is the file's own)."""
    loaded: dict[str, tuple[Any, Any]] = {}  # path -> (an untouched copy of the model it gave, its tokenizer)

    def load(spec: ModelSpec) -> AsyncEngine:
        config = EngineConfig.of(kv_cache_memory=spec.kv_cache_memory or KV, model=spec.path)  # as served
        if spec.path is not None and spec.path in loaded:
            model, tokenizer = loaded[spec.path]
            return AsyncEngine(LLMEngine(copy.deepcopy(model), tokenizer, config))  # (what from_config does)
        if spec.path is not None:
            engine = LLMEngine.from_config(config)
            loaded[spec.path] = copy.deepcopy(engine.model), engine.tokenizer
            return AsyncEngine(engine)
        model = llm.model if spec.name == "big" else big2_weights
        return AsyncEngine(LLMEngine(model, llm.tokenizer, config))
    return load


def settings_for(tiny: Path, probe_interval: float = 0.0, **extra: Any) -> Settings:
    """`probe_interval`: 0, the start-up probe only; the idle probes of three models every 0.2 s
    would keep the two cores busy under every other test (only the failing-probe test needs them)."""
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    return Settings.model_validate({
        "server": {"probe_interval_seconds": probe_interval, "admin_key_sha256": [digest]},
        "models": {
            "big": {"revision": "a", "aliases": ["smol"]},
            "big2": {"revision": "b", "fallback": "tiny"},
            "tiny": {"path": str(tiny), "kv_cache_memory": "16MiB"},
        },
        "routes": {
            "canary": {"targets": {"big": 90, "tiny": 10}},
            "vip": {"targets": {"tiny": 1}, "rules": [{"classes": ["interactive"], "model": "big"}]},
            "auto-sure": {"kind": "cascade", "small": "tiny", "large": "big", "threshold": -1000.0},
            "auto-unsure": {"kind": "cascade", "small": "tiny", "large": "big", "threshold": 0.0},
        },
        "degradation": {"hold_seconds": 0, "recover_seconds": 2.0, "classes": ["batch"], "max_tokens_ceiling": 3},
        **extra,
    })


@asynccontextmanager
async def serve_models(llm: LLMEngine, big2_weights: Any, tiny_folder: Path,
                       probe_interval: float = 0.0) -> AsyncIterator[Server]:
    settings = settings_for(tiny_folder, probe_interval)
    fleet = load_models(settings, loader(llm, big2_weights))
    user = hashlib.sha256(USER_KEY.encode()).hexdigest()
    async with serve(fleet, settings, api_keys=frozenset({user})) as s:
        s.session.headers["Authorization"] = f"Bearer {USER_KEY}"
        yield s


@pytest_asyncio.fixture
async def server(llm: LLMEngine, big2_weights: Any, tiny_folder: Path) -> AsyncIterator[Server]:
    async with serve_models(llm, big2_weights, tiny_folder) as s:
        yield s


@pytest_asyncio.fixture
async def probing_server(llm: LLMEngine, big2_weights: Any, tiny_folder: Path) -> AsyncIterator[Server]:
    """Every model probed again each 0.2 s while idle."""
    async with serve_models(llm, big2_weights, tiny_folder, probe_interval=0.2) as s:
        yield s


def fleet_of(server: Server) -> ModelRegistry:
    return server.test_server.app[REGISTRY]


async def complete(server: Server, model: str, **extra: Any) -> tuple[int, Any, str | None]:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, **extra}
    async with server.session.post("/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None), r.headers.get("x-inferd-model")


async def admin(server: Server, path: str, body: Any = None, key: str | None = ADMIN_KEY) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {"Authorization": ""}
    async with server.session.post(path, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def test_models_aliases_and_routes_are_listed_and_answer_by_name(server: Server) -> None:
    status, listing = await server.get("/v1/models")
    cards = {card["id"]: card for card in listing["data"]}
    assert status == 200 and set(cards) == {"big", "smol", "big2", "tiny", "canary", "vip", "auto-sure",
                                            "auto-unsure"}
    assert (cards["big"]["revision"], cards["big2"]["revision"], cards["smol"]["alias_of"]) == ("a", "b", "big")
    assert cards["canary"]["route"] == {"big": 0.9, "tiny": 0.1}
    for asked, model, label in (("big", "big", "big@a"), ("smol", "big", "big@a"), ("big2", "big2", "big2@b"),
                                ("tiny", "tiny", "tiny@1")):
        status, body, header = await complete(server, asked)
        assert (status, body["model"], header) == (200, model, label), body
    status, body, _ = await complete(server, "nope")
    assert_error(status, body, 404, param="model", code="model_not_found")
    # a route's rule by class: interactive -> big, the rest -> tiny
    assert (await complete(server, "vip", priority="interactive"))[2] == "big@a"
    assert (await complete(server, "vip", priority="batch"))[2] == "tiny@1"
    async with server.session.get("/metrics") as r:
        text = await r.text()
    assert 'inferd_model_requests_total{model="big",revision="a"}' in text


# (requests, how far the small share may stray from 10%): the soak tier's 400 within 5 points;
# the default tier's twin 100, within 10 (three standard deviations of a 10% share)
SPLITS = [pytest.param(400, 0.05, marks=pytest.mark.soak, id="400"), pytest.param(100, 0.10, id="100")]


@pytest.mark.parametrize(("requests", "points"), SPLITS)
async def test_a_90_10_route_splits_400_requests_within_5_points_and_sticks_per_user(
        server: Server, requests: int, points: float) -> None:
    gate = asyncio.Semaphore(32)

    async def one(user: str | None) -> str | None:
        async with gate:
            status, body, header = await complete(server, "canary", max_tokens=1,
                                                  **({"user": user} if user else {}))
            assert status == 200, body
            return header

    answered = Counter(await asyncio.gather(*(one(None) for _ in range(requests))))
    assert set(answered) == {"big@a", "tiny@1"}
    assert abs(answered["tiny@1"] / requests - 0.10) <= points, answered
    users = [f"user-{i}" for i in range(20)]
    picks = await asyncio.gather(*(one(user) for user in users for _ in range(3)))
    for i, user in enumerate(users):
        assert len(set(picks[3 * i:3 * i + 3])) == 1, (user, picks[3 * i:3 * i + 3])


async def test_a_model_failing_its_probe_sends_to_its_fallback_until_recovered(probing_server: Server) -> None:
    server = probing_server
    fleet = fleet_of(server)
    slot = fleet.slots["big2"]
    norm = _model_of(fleet, "big2").norm.weight  # (big2's own copy of the weights, see loader)
    saved = norm.clone()
    try:
        with torch.no_grad():
            norm.neg_()  # every logit flips sign: the probe's first token loses, the probe fails
        await _until(lambda: slot.degradation.use_fallback, 15)
        status, body, header = await complete(server, "big2")
        assert (status, body["model"], header) == (200, "tiny", "tiny@1")
        async with server.session.post("/v1/completions", json={"model": "big2", "prompt": "Hi", "max_tokens": 1}) as r:
            assert r.headers["x-inferd-fallback-from"] == "big2"
        _, status_body = await server.get("/v1/status")
        row = next(m for m in status_body["models"] if m["name"] == "big2")
        assert row["degraded"] and row["degraded_reason"] == "unhealthy" and row["fallbacks"] >= 2
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    await _until(lambda: not slot.degradation.use_fallback, 20)  # probe passes, then 2 s clear
    assert (await complete(server, "big2"))[2] == "big2@b"
    assert slot.degradation.switches == 2  # on once, off once: no flapping while it recovered


async def test_a_persistent_overload_read_from_the_engine_sends_to_the_fallback(server: Server) -> None:
    """The triggers' plumbing: the engine's own snapshot (its queue-time p95) through ModelRegistry.watch."""
    slot = fleet_of(server).slots["big2"]
    slot.degradation = ModelDegradation(Triggers(queue_p95_seconds=1e-9, hold_seconds=1.0, recover_seconds=600))
    assert (await complete(server, "big2"))[2] == "big2@b"  # a queue time > 1 ns: overloaded from now on
    await _until(lambda: slot.degradation.use_fallback, 10)
    assert slot.degradation.reason is not None and slot.degradation.reason.startswith("queue time p95")
    assert (await complete(server, "big2"))[2] == "tiny@1"


async def test_a_cascade_escalates_only_when_the_small_answer_is_unsure(server: Server) -> None:
    tiny = fleet_of(server).slots["tiny"]
    status, body, header = await complete(server, "auto-sure", max_tokens=4)
    assert (status, header, tiny.counts.escalations) == (200, "tiny@1", 0)
    assert tiny.counts.tokens_saved == body["usage"]["total_tokens"] > 0
    assert body["choices"][0]["logprobs"] is None  # (asked for internally, not shown)
    status, body, header = await complete(server, "auto-unsure", max_tokens=4)
    assert (status, header, tiny.counts.escalations) == (200, "big@a", 1)
    async with server.session.get("/metrics") as r:
        text = await r.text()
    assert 'inferd_cascade_escalations_total{model="tiny",revision="1"} 1.0' in text
    async with server.session.post("/v1/completions", json={"model": "auto-sure", "prompt": "Hi", "max_tokens": 2,
                                                            "stream": True}) as r:
        assert_error(r.status, await r.json(), 400, param="stream", code="cascade_not_streamable")


def ladder_at(level: int) -> FunctionalDegradation:
    """A ladder walked up to `level` by a real overload, that stays there (a 10-minute recovery)."""
    ladder, now = FunctionalDegradation(hold_seconds=0, recover_seconds=600), 0.0
    while ladder.level < level:
        now += 1
        ladder.update(now, True)
    return ladder


async def test_functional_degradation_answers_streams_whole_then_caps_then_refuses_the_lowest_class(
        server: Server) -> None:
    slot = fleet_of(server).slots["big"]
    body = {"model": "big", "prompt": "Count to ten:", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "priority": "batch"}
    slot.ladder = ladder_at(1)  # streams whole: one event with all the text
    _, events = await server.stream("/v1/completions", body)
    texts = [c["choices"][0]["text"] for c in data_events(events) if c["choices"] and c["choices"][0]["text"]]
    assert len(texts) == 1 and len(texts[0]) > 10, texts
    _, events = await server.stream("/v1/completions", {**body, "priority": "interactive"})  # not in its classes
    assert len([c for c in data_events(events) if c["choices"] and c["choices"][0]["text"]]) > 1
    slot.ladder = ladder_at(2)  # and max_tokens capped at the ceiling
    status, reply = await server.post("/v1/completions", body)
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    slot.ladder = ladder_at(3)  # and the lowest of its classes refused
    async with server.session.post("/v1/completions", json=body) as r:
        assert_error(r.status, await r.json(), 503, code="degraded")
        assert r.headers["Retry-After"] == "2"
    status, reply = await server.post("/v1/completions", {**body, "priority": "interactive"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 12
    _, status_body = await server.get("/v1/status")
    assert next(m for m in status_body["models"] if m["name"] == "big")["functional_level"] == "refuse_lowest"


async def test_admin_model_endpoints_need_the_admin_key_and_a_known_model(server: Server) -> None:
    assert (await admin(server, "/admin/models/big/reload", key=None))[0] == 401
    status, body = await admin(server, "/admin/models/big/reload", key=USER_KEY)
    assert_error(status, body, 403)
    status, body = await admin(server, "/admin/models/nope/reload", {})
    assert_error(status, body, 404, code="model_not_found")
    status, body = await admin(server, "/admin/models/big/rollback")
    assert_error(status, body, 409, code="no_previous_revision")


async def test_a_models_door_counts_outlive_a_reload(server: Server) -> None:
    """Refusals at the door and structured outputs belong to the model's slot, not to a revision's
    door: a reload keeps counting where the old revision stopped (in /metrics and /v1/status)."""
    assert (await complete(server, "big"))[0] == 200  # (a prefill rate measured: deadlines can be predicted)
    status, body, _ = await complete(server, "big", prompt="Hi " * 200, ttft_timeout=1e-4)
    assert_error(status, body, 429, code="deadline")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    status, body, _ = await complete(server, "big", response_format=bad)
    assert_error(status, body, 400, code="invalid_grammar")
    status, reloaded = await admin(server, "/admin/models/big/reload", {"revision": "r2"})
    assert (status, reloaded["revision"]) == (200, "r2"), reloaded
    async with server.session.get("/metrics") as r:
        text = await r.text()
    assert 'inferd_model_rejections_total{model="big",reason="deadline",revision="r2"} 1.0' in text, text
    assert 'inferd_model_structured_requests_total{kind="invalid",model="big",revision="r2"} 1.0' in text
    assert 'inferd_rejections_total{reason="deadline"} 1.0' in text  # every model's, summed
    assert 'inferd_structured_requests_total{kind="invalid"} 1.0' in text
    _, page = await server.get("/v1/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert page["rejections"] == {"deadline": 1}  # the first model's, across its revisions


async def test_a_tenants_fair_share_is_summed_over_every_models_engine(llm: LLMEngine, big2_weights: Any,
                                                                        tiny_folder: Path) -> None:
    """Each engine keeps its own fair-share counters; /v1/status, /admin/tenants and /metrics
    show a tenant's over every model, not the first model's alone."""
    key = "sk-tenant-acme"
    # no idle probe: a tenant's counter is kept while no other tenant is active (fairness.py forgets
    # an idle one below the active ones' counters)
    server_table = {"probe_interval_seconds": 0, "admin_key_sha256": [hashlib.sha256(ADMIN_KEY.encode()).hexdigest()]}
    settings = settings_for(tiny_folder, server=server_table,
                            tenants={"acme": {"key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}})
    async with serve(load_models(settings, loader(llm, big2_weights)), settings) as server:
        server.session.headers["Authorization"] = f"Bearer {key}"
        for model in ("big", "tiny"):
            assert (await complete(server, model, max_tokens=3))[0] == 200
        slots = fleet_of(server).slots.values()
        await _until(lambda: all(s.current.engine.snapshot.running == 0 for s in slots), 5)  # final counters out
        engines = [slot.current.engine.snapshot.tenants for slot in slots]
        counters = [t.virtual_tokens for tenants in engines for t in tenants if t.name == "acme"]
        assert len(counters) == 2 and all(c > 0 for c in counters), engines  # big's and tiny's
        _, page = await server.get("/v1/status")
        [row] = page["tenants"]
        assert row["name"] == "acme" and row["virtual_tokens"] == pytest.approx(sum(counters))
        _, table = await server.get("/admin/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert table["data"][0]["status"]["virtual_tokens"] == pytest.approx(sum(counters))
        async with server.session.get("/metrics") as r:
            text = await r.text()
        line = next(line for line in text.splitlines() if line.startswith('inferd_tenant_virtual_tokens{tenant="acme"}'))
        assert float(line.split()[-1]) == pytest.approx(sum(counters))


@pytest.mark.parametrize("streams", [pytest.param(16, marks=pytest.mark.soak), 2])
async def test_reload_under_streams_completes_them_all_and_frees_the_old_revision(
        server: Server, llm: LLMEngine, tmp_path: Path, streams: int) -> None:
    fleet, gguf = fleet_of(server), llm.limits.model_path
    _, body, _ = await complete(server, "big", max_tokens=6)
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"prompt": "The capital of France is", "expected": body["choices"][0]["text"]}))
    fleet.slots["big"].current.spec = dataclasses.replace(fleet.slots["big"].current.spec, eval_file=str(eval_file))
    stream_body = {"model": "big", "prompt": "Count slowly:", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    running = [asyncio.ensure_future(server.stream("/v1/completions", stream_body)) for _ in range(streams)]
    await _until(lambda: fleet.slots["big"].current.engine.snapshot.running >= streams, 20)
    status, reloaded = await admin(server, "/admin/models/big/reload", {"path": gguf, "revision": "b"})
    assert (status, reloaded["revision"]) == (200, "b"), reloaded
    assert (await complete(server, "smol"))[2] == "big@b"  # new requests: the new revision at once
    for response, events in await asyncio.gather(*running):
        chunks = data_events(events)
        assert response.status == 200 and events[-1].endswith("data: [DONE]")
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # none cut short
    # a second reload: revision b (loaded from the file) must be freed once it has retired
    old_weights, old_engine = weakref.ref(_model_of(fleet, "big")), weakref.ref(fleet.slots["big"].current.engine._engine)
    status, _ = await admin(server, "/admin/models/big/reload", {"revision": "c"})
    assert status == 200
    await _until(lambda: not fleet.slots["big"].retiring, 20)
    gc.collect()
    assert old_weights() is None, "the retired revision's weights are still referenced"
    assert old_engine() is None, "the retired revision's engine (its KV pool) is still referenced"
    # rollback: back to b; then a revision failing its evaluation set, and a truncated file
    status, back = await admin(server, "/admin/models/big/rollback")
    assert (status, back["revision"]) == (200, "b")
    bad_eval = tmp_path / "bad.jsonl"
    bad_eval.write_text(json.dumps({"prompt": "The capital of France is", "expected": " certainly not this"}))
    await _reload_with_eval(server, fleet, bad_eval)
    truncated = tmp_path / "truncated.gguf"
    with open(gguf, "rb") as src:
        truncated.write_bytes(src.read(2**21))  # the header and the start of the weights
    status, body = await admin(server, "/admin/models/big/reload", {"path": str(truncated), "revision": "t"})
    assert_error(status, body, 422, code="revision_rejected")
    assert "did not load" in body["error"]["message"]
    assert (await complete(server, "big"))[2] == "big@b"  # the old one keeps serving
    assert fleet.slots["big"].counts.reloads_refused == 2


async def _reload_with_eval(server: Server, fleet: ModelRegistry, eval_file: Path) -> None:
    """A reload with an evaluation set the model does not pass (as [models.big] eval_file would name)."""
    slot = fleet.slots["big"]
    slot.current.spec = dataclasses.replace(slot.current.spec, eval_file=str(eval_file))
    status, body = await admin(server, "/admin/models/big/reload", {"revision": "e"})
    assert_error(status, body, 422, code="revision_rejected")
    assert "evaluation set" in body["error"]["message"]
    assert (await complete(server, "big"))[2] == "big@b"


def _model_of(fleet: ModelRegistry, name: str) -> Any:
    return fleet.slots[name].current.engine._engine.model


async def _until(condition: Any, within: float) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
