"""Fixtures for the API tests: one model load per session, a fresh AsyncEngine + app +
TestServer per test (an AsyncEngine does not restart once stopped)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from apiserver import Server, serve

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def llm(float32_weights: tuple) -> LLMEngine:
    return LLMEngine(*float32_weights, EngineConfig(dtype="float32", kv_cache_memory=256 * 2**20))


@pytest_asyncio.fixture
async def server(llm: LLMEngine) -> AsyncIterator[Server]:
    async with serve(llm) as s:
        yield s
