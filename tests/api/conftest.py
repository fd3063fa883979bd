"""Fixtures for the API tests: one model load per session, then per test a fresh LLMEngine over
those weights (its scheduler's state, the load shedder's level among it, must not carry from one
test into the next) and a fresh AsyncEngine + app + TestServer (an AsyncEngine does not restart
once stopped)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from apiserver import Server, serve

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine


@pytest.fixture
def llm(served_weights: tuple) -> LLMEngine:
    return LLMEngine(*served_weights, EngineConfig.of(kv_cache_memory=128 * 2**20))


@pytest_asyncio.fixture
async def server(llm: LLMEngine) -> AsyncIterator[Server]:
    async with serve(llm) as s:
        yield s
