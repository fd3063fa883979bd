"""The prefix cache keeps tenants apart: one tenant's cached prompt never serves another's
request (its TTFT would tell what the first asked); tenants of one cache_group share; a
request's cache_salt narrows its tenant's namespace further."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from apiserver import MODEL, Server, serve

from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import Settings

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

TENANTS = {"alpha": None, "beta": None, "docs-a": "public", "docs-b": "public"}  # name: cache_group


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest_asyncio.fixture
async def tenants_server(llm: LLMEngine) -> AsyncIterator[Server]:
    settings = Settings.model_validate({"tenants": {
        name: {"key_sha256": [sha(f"sk-{name}")], **({"cache_group": group} if group else {})}
        for name, group in TENANTS.items()}})
    async with serve(llm, settings) as s:
        yield s


def long_prompt() -> str:
    """~160 tokens (ten 16-token blocks) no earlier test has sent (a fresh uuid first: nothing of
    it is cached yet)."""
    return f"{uuid.uuid4()} " + " ".join(f"Clause {i}: the parties agree to item {i * 7}." for i in range(10))


async def cached_after(server: Server, tenant: str, prompt: str, **fields: object) -> float:
    """How many prompt tokens the prefix cache served this request (inferd_prefix_cache_hits' step)."""
    before = await hits(server)
    status, body = await server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0, **fields},
                                     headers={"Authorization": f"Bearer sk-{tenant}"})
    assert status == 200, body
    return await hits(server) - before


async def hits(server: Server) -> float:
    async with server.session.get("/metrics") as r:
        text = await r.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("inferd_prefix_cache_hits"))


async def test_another_tenants_prompt_is_not_served_from_the_cache(tenants_server: Server) -> None:
    prompt = long_prompt()
    assert await cached_after(tenants_server, "alpha", prompt) == 0
    assert await cached_after(tenants_server, "alpha", prompt) >= 128  # its own repeat hits
    assert await cached_after(tenants_server, "beta", prompt) == 0  # a cold prefill, as if never seen
    assert await cached_after(tenants_server, "beta", prompt) >= 128  # (then beta's own copy)


async def test_a_cache_group_shares_and_a_cache_salt_narrows(tenants_server: Server) -> None:
    prompt = long_prompt()
    assert await cached_after(tenants_server, "docs-a", prompt) == 0
    assert await cached_after(tenants_server, "docs-b", prompt) >= 128  # the same group: shared
    assert await cached_after(tenants_server, "alpha", prompt) == 0  # outside the group: not
    salted = long_prompt()
    assert await cached_after(tenants_server, "docs-a", salted, cache_salt="s3cret") == 0
    assert await cached_after(tenants_server, "docs-b", salted) == 0  # the group without the salt
    assert await cached_after(tenants_server, "docs-b", salted, cache_salt="other") == 0
    assert await cached_after(tenants_server, "docs-b", salted, cache_salt="s3cret") >= 128
