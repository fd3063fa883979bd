"""The fault suite: a real server (aiohttp's TestServer on a real socket, the real default model
as served by default) with faults injected through `LLMEngine.faults` (engine/worker/faults.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402


CONFIG = EngineConfig.of(kv_cache_memory=64 * 2**20)


@pytest.fixture(scope="session")
def loaded(served_weights: tuple) -> LLMEngine:
    return LLMEngine(*served_weights, CONFIG)


@pytest.fixture
def llm(loaded: LLMEngine) -> Iterator[LLMEngine]:
    """A fresh engine over the session's model (weights loaded once): no fault armed, and
    nothing a fault left behind (a lowered token budget, failure counts) carries over."""
    yield LLMEngine(loaded.model, loaded.tokenizer, CONFIG)
