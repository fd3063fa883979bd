"""The gateway over real HTTP: tenants' keys, what they may use, their rate limits and headers,
their accounts in /v1/status and /metrics, the admin surface, and keys that never leave."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from typing import Any

import pytest
from apiserver import Server, assert_error, serve

from inferd.api.gateway.tenants import Keyring
from inferd.settings.config import Settings, load_settings
from inferd.settings.values import SettingsError
from inferd.engine.llm_engine import LLMEngine

ACME, BETA, ADMIN, PLAIN = "sk-acme-0001", "sk-beta-0002", "sk-admin-0003", "sk-plain-0004"
RATE_HEADERS = [f"x-ratelimit-{part}-{kind}" for kind in ("requests", "tokens") for part in ("limit", "remaining", "reset")]
DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tenant_settings(tenants: dict[str, dict[str, Any]], **server: Any) -> Settings:
    return Settings.model_validate({"tenants": tenants, "server": {"admin_key_sha256": [sha(ADMIN)], **server}})


TWO = {
    "acme": {"key_sha256": [sha(ACME)], "classes": ["batch"], "default_class": "batch", "tier": "paid"},
    "beta": {"key_sha256": [sha(BETA)], "models": ["another-model"], "tier": "free"},
}


async def complete(server: Server, key: str, **body: Any) -> tuple[int, Any, dict[str, str]]:
    payload = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, **body}
    async with server.session.post("/v1/completions", json=payload, headers=bearer(key)) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


@pytest.mark.served
@pytest.mark.asyncio
async def test_keys_and_what_each_tenant_may_use(llm: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inferd.requests")
    async with serve(llm, tenant_settings(TWO), frozenset({sha(PLAIN)})) as server:
        assert_error(*await server.post("/v1/completions", {"model": "smollm2", "prompt": "x"}), 401,
                     code="invalid_api_key")
        assert_error(*await server.post("/v1/completions", {"model": "smollm2", "prompt": "x"},
                                        headers=bearer("sk-nobody")), 401, code="invalid_api_key")
        # beta may use another model only; acme the batch class only
        status, body, _ = await complete(server, BETA)
        assert_error(status, body, 403, param="model", code="model_not_allowed")
        assert "'beta'" in body["error"]["message"] and "'smollm2'" in body["error"]["message"]
        status, body, _ = await complete(server, ACME, priority="interactive")
        assert_error(status, body, 403, param="priority", code="class_not_allowed")
        assert "['batch']" in body["error"]["message"]
        status, body, _ = await complete(server, ACME)  # its default class: batch
        assert status == 200, body
        status, body, _ = await complete(server, PLAIN, priority="interactive")  # a plain key: no tenant
        assert status == 200, body
        # the admin surface: the admin key only
        assert_error(*await server.get("/admin/tenants", headers=bearer(ACME)), 403, code="admin_key_required")
        assert_error(*await server.get("/admin/tenants", headers=bearer(PLAIN)), 403)
        status, body = await server.get("/admin/tenants", headers=bearer(ADMIN))
        assert status == 200 and [t["name"] for t in body["data"]] == ["acme", "beta"]
        acme = body["data"][0]
        assert acme["tier"] == "paid" and acme["classes"] == ["batch"] and acme["status"]["requests"] == 1
        assert acme["status"]["rejections"] == {"class_not_allowed": 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "inferd.requests"]
    assert any("tenant=acme" in line and "class=batch" in line and "status=200" in line for line in lines), lines
    assert any("status=403" in line and "tenant=beta" in line for line in lines), lines


@pytest.mark.served
@pytest.mark.asyncio
async def test_two_requests_a_second_burst_two_ten_at_once(llm: LLMEngine) -> None:
    tenants = {"acme": {"key_sha256": [sha(ACME)], "requests_per_second": 2, "requests_burst": 2}}
    async with serve(llm, tenant_settings(tenants)) as server:
        burst = time.monotonic()
        results = await asyncio.gather(*(complete(server, ACME, max_tokens=1) for _ in range(10)))
        admitted = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(admitted) == 2 and len(refused) == 8, [r[0] for r in results]
        for status, body, headers in refused:
            assert_error(status, body, 429, code="rate_limit_exceeded", type_="requests")
            assert 1 <= int(headers["Retry-After"]) <= 1  # half a second to the next request, rounded up
            assert headers["x-ratelimit-remaining-requests"] == "0"
        for _, _, headers in results:
            assert headers["x-ratelimit-limit-requests"] == "2"
            assert 0 <= int(headers["x-ratelimit-remaining-requests"]) <= 1
            assert DURATION.match(headers["x-ratelimit-reset-requests"]), headers
            assert "x-ratelimit-limit-tokens" not in headers  # no token limit configured
        await asyncio.sleep(0.6)  # one request refilled
        status, _, headers = await complete(server, ACME, max_tokens=1)
        # none left once it is taken, unless a slow machine let a whole second pass since the burst
        left = {"0"} if time.monotonic() - burst < 1.0 else {"0", "1"}
        assert status == 200 and headers["x-ratelimit-remaining-requests"] in left, headers


@pytest.mark.served
@pytest.mark.asyncio
async def test_token_bucket_charges_max_tokens_and_refunds_what_was_not_generated(llm: LLMEngine) -> None:
    burst, rate = 400, 100
    tenants = {"acme": {"key_sha256": [sha(ACME)], "tokens_per_second": rate, "tokens_burst": burst}}
    async with serve(llm, tenant_settings(tenants)) as server:
        # a chat answer that ends long before its max_tokens: charged ~330, refunded what it did not use
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 300,
                "temperature": 0}
        async with server.session.post("/v1/chat/completions", json=chat, headers=bearer(ACME)) as r:
            body, headers = await r.json(), dict(r.headers)
        used, charged = body["usage"]["total_tokens"], body["usage"]["prompt_tokens"] + 300
        assert body["choices"][0]["finish_reason"] == "stop" and used < charged - 100
        remaining = int(headers["x-ratelimit-remaining-tokens"])
        assert remaining >= burst - used  # the refund is in the header ...
        assert headers["x-ratelimit-limit-tokens"] == str(burst) and "x-ratelimit-limit-requests" not in headers
        # ... which without it would read burst - charged + what refilled in a fraction of a second
        assert remaining > burst - charged + 100
        # a request that could never fit the bucket: a 400 that says so
        status, body, _ = await complete(server, ACME, max_tokens=burst)
        assert_error(status, body, 400, param="max_tokens", code="rate_limit_too_large")
        assert f"tokens_burst is {burst}" in body["error"]["message"]
        # two long prompts at once: one admitted, the other refused until the bucket has refilled
        # (sent together, so that what refills while the first runs cannot decide the second)
        long_prompt = [504] * 300
        await asyncio.sleep(max(0.0, (len(long_prompt) + 2 - remaining) / rate))  # (room for one)
        first, second = sorted(await asyncio.gather(*(complete(server, ACME, prompt=long_prompt, max_tokens=1)
                                                      for _ in range(2))), key=lambda answer: answer[0])
        assert first[0] == 200, first
        status, body, headers = second
        assert_error(status, body, 429, code="rate_limit_exceeded", type_="tokens")
        wait = int(headers["Retry-After"])
        assert 1 <= wait <= 3 and int(headers["x-ratelimit-remaining-tokens"]) < 301
        await asyncio.sleep(wait)
        status, body, _ = await complete(server, ACME, prompt=long_prompt, max_tokens=1)
        assert status == 200, body


async def _text(server: Server, method: str, path: str, key: str | None) -> str:
    async with server.session.request(method, path, headers=bearer(key) if key else {}) as r:
        return await r.text()


@pytest.mark.served
@pytest.mark.asyncio
async def test_no_key_or_digest_ever_leaves_the_server(llm: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    tenants = {**TWO, "acme": {**TWO["acme"], "requests_per_second": 1, "requests_burst": 1}}
    async with serve(llm, tenant_settings(tenants)) as server:
        assert (await complete(server, ACME))[0] == 200
        assert (await complete(server, ACME))[0] == 429
        assert (await complete(server, BETA))[0] == 403
        texts = [await _text(server, "GET", path, key) for path, key in
                 [("/v1/status", ADMIN), ("/v1/status", ACME), ("/metrics", None), ("/admin/tenants", ADMIN),
                  ("/v1/models", BETA), ("/openapi.json", ADMIN)]]
    metrics = texts[2]
    assert 'inferd_tenant_requests_total{tenant="acme"} 1.0' in metrics
    assert 'inferd_tenant_rejections_total{reason="rate_limit_requests",tenant="acme"} 1.0' in metrics
    assert 'inferd_tenant_rejections_total{reason="model_not_allowed",tenant="beta"} 1.0' in metrics
    assert 'inferd_tenant_ttft_seconds_count{tenant="acme"} 1.0' in metrics
    secrets = [s for key in (ACME, BETA, ADMIN) for s in (key, sha(key), sha(key).upper(), sha(key)[:16])]
    for text in [*texts, caplog.text]:
        assert not [s for s in secrets if s in text]


@pytest.mark.served
@pytest.mark.asyncio
async def test_a_tenant_sees_only_its_own_requests_and_row(llm: LLMEngine) -> None:
    tenants = {"acme": {"key_sha256": [sha(ACME)], "weight": 2}, "beta": {"key_sha256": [sha(BETA)]}}
    async with serve(llm, tenant_settings(tenants)) as server:
        # the streams are held open until the views are read, however fast the CPU decodes: the
        # test ends them itself (a disconnect returns their blocks)
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        streams = [await server.session.post("/v1/completions", json=body, headers=bearer(key))
                   for key in (ACME, BETA)]
        try:
            for r in streams:
                await r.content.readline()  # both have started
            # the engine publishes its snapshot every 50 ms: look once it holds both requests
            deadline = asyncio.get_running_loop().time() + 30
            while len((await server.get("/v1/status", headers=bearer(ADMIN)))[1]["requests"]) < 2:
                assert asyncio.get_running_loop().time() < deadline, "the two streams never ran together"
                await asyncio.sleep(0.01)
            views = {key: (await server.get("/v1/status", headers=bearer(key)))[1] for key in (ACME, BETA, ADMIN)}
        finally:
            for r in streams:
                r.close()
    for key, name in ((ACME, "acme"), (BETA, "beta")):
        view = views[key]
        assert [t["name"] for t in view["tenants"]] == [name]
        assert view["requests"] and {r["tenant"] for r in view["requests"]} == {name}
    admin = views[ADMIN]
    assert {r["tenant"] for r in admin["requests"]} == {"acme", "beta"}
    rows = {t["name"]: t for t in admin["tenants"]}
    assert rows["acme"]["weight"] == 2 and rows["acme"]["running"] + rows["acme"]["waiting"] == 1


@pytest.mark.served
@pytest.mark.asyncio
async def test_status_may_be_kept_for_the_admin(llm: LLMEngine) -> None:
    async with serve(llm, tenant_settings(TWO, status_admin_only=True)) as server:
        assert_error(*await server.get("/v1/status", headers=bearer(ACME)), 403, code="admin_key_required")
        status, body = await server.get("/v1/status", headers=bearer(ADMIN))
        assert status == 200 and len(body["tenants"]) == 2


@pytest.mark.served
@pytest.mark.asyncio
async def test_reload_swaps_keys_and_keeps_what_a_tenant_used(llm: LLMEngine) -> None:
    first = {"acme": {"key_sha256": [sha(ACME)], "requests_per_second": 0.01, "requests_burst": 2}}
    later: dict[str, Any] = {"tenants": first}

    def reload() -> Keyring:
        return Keyring.build(tenant_settings(later["tenants"]))

    async with serve(llm, tenant_settings(first), reload_keys=reload) as server:
        assert (await complete(server, ACME))[0] == 200
        assert (await complete(server, BETA))[0] == 401
        later["tenants"] = {**first, "beta": {"key_sha256": [sha(BETA)]}}
        assert_error(*await server.post("/admin/reload", {}, headers=bearer(ACME)), 403)
        status, body = await server.post("/admin/reload", {}, headers=bearer(ADMIN))
        assert status == 200 and body == {"keys": 3, "tenants": ["acme", "beta"]}
        assert (await complete(server, BETA))[0] == 200
        status, _, headers = await complete(server, ACME)  # its bucket kept its level across the reload
        assert status == 200 and headers["x-ratelimit-remaining-requests"] == "0"
        later["tenants"] = {"acme": {"key_sha256": [sha(ACME)], "classes": ["no-such-class"]}}
        status, body = await server.post("/admin/reload", {}, headers=bearer(ADMIN))
        assert_error(status, body, 400, code="invalid_settings")
        assert "no-such-class" in body["error"]["message"]
        assert (await complete(server, BETA))[0] == 200  # the old keys still serve


def test_settings_refuse_bad_tenants() -> None:
    def refused(tenants: dict[str, Any]) -> str:
        data = {"tenants": tenants, "server": {"admin_key_sha256": [sha(ADMIN)]}}
        with pytest.raises(SettingsError) as e:
            load_settings(overrides=data, environ={})
        return str(e.value)

    assert "not a SHA-256 hex digest" in refused({"a": {"key_sha256": [ACME]}})
    assert ACME not in refused({"a": {"key_sha256": [ACME]}})
    assert "also a key of tenant 'a'" in refused({"a": {"key_sha256": [sha(ACME)]}, "b": {"key_sha256": [sha(ACME)]}})
    assert "also a key of the admin keys" in refused({"a": {"key_sha256": [sha(ADMIN)]}})
    assert "unknown classes ['gold']" in refused({"a": {"classes": ["gold"]}})
    assert "requests_burst needs requests_per_second" in refused({"a": {"requests_burst": 3}})
    assert "tenant name" in refused({"a b": {}})
