"""Readiness and the inference probe on the real default model: ready once the start-up probe
has run, 503 with the reason once a weight is corrupted in place, ready again once repaired."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from apiserver import serve

from inferd.api.routing.registry import REGISTRY
from inferd.settings.config import Settings
from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]


async def wait_for(server, status: int, within: float = 10.0) -> dict:
    deadline = time.monotonic() + within
    while True:
        code, body = await server.get("/ready")
        if code == status:
            return body
        assert time.monotonic() < deadline, (code, body)
        await asyncio.sleep(0.05)


async def test_a_corrupted_weight_makes_the_server_not_ready(llm: LLMEngine) -> None:
    settings = Settings.model_validate({"server": {"probe_interval_seconds": 0.2}})
    async with serve(llm, settings) as server:
        assert await server.get("/ready") == (200, {"status": "ready"})
        probe = server.test_server.app[REGISTRY].primary.current.probe
        norm = llm.model.norm.weight  # read by every product path, packed or dense
        saved = norm.clone()
        try:
            with torch.no_grad():
                norm.neg_()  # every logit flips sign: the probe's first token loses
            body = await wait_for(server, 503)
            assert body["status"] == "not_ready" and "inference probe produced" in body["reason"]
            _, status = await server.get("/v1/status")
            assert status["state"] == "not_ready"
        finally:
            with torch.no_grad():
                norm.copy_(saved)
        assert await wait_for(server, 200) == {"status": "ready"}  # repaired: it passes again
        assert probe.runs >= 2
