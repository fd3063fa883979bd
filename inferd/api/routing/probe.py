"""The inference probe: a fixed greedy prompt, run at start-up and again while idle.

The start-up run records the tokens this model produces for it on this machine; the server is
ready only once it has. A later run that produces other tokens means the model no longer
computes what it did (corrupted weights, a failing device): the server turns not ready and
says why in the log. Runs that overlapped with other requests are not compared, since batch
composition may change low-order bits of the arithmetic (and so, rarely, a greedy token).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from inferd.api.state import ServerState
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.protocol import EngineRequest
from inferd.text.sampling_params import SamplingParams

log = logging.getLogger(__name__)

PROMPT = "The three primary colours are"
MAX_TOKENS = 8
IDLE_RETRY_SECONDS = 0.5  # how soon to try again when the engine was busy


@dataclass
class ModelHealth:
    """One loaded revision's inference probe verdict (the probe writes it; event loop only)."""

    probed: bool = False  # the start-up inference probe has run
    probe_error: str | None = None  # the last probe's failure, if it failed


class InferenceProbe:
    """One model's probe (each revision of each model has its own); its verdict goes to `health`."""

    def __init__(self, engine: AsyncEngine, health: ModelHealth, interval: float, server: ServerState) -> None:
        self.engine = engine
        self.health = health
        self.state = server  # (for draining)
        self.interval = interval  # 0: start-up only
        self.expected: list[int] | None = None
        self.runs = 0  # compared runs, for tests and logs
        self._prompt = engine.tokenizer.encode(PROMPT)
        self._params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def first(self) -> list[int]:
        """The start-up probe: the tokens recorded, once the engine has had a quiet moment."""
        while self.expected is None:
            self.expected = await self._alone()
            if self.expected is None:
                await asyncio.sleep(IDLE_RETRY_SECONDS)
        self.health.probed = True
        log.info("inference probe: %d tokens recorded; ready", len(self.expected))
        return self.expected

    async def run(self) -> None:
        """The start-up probe, then (with an interval) the periodic ones; runs until cancelled."""
        await self.first()
        while self.interval > 0:
            await asyncio.sleep(self.interval)
            tokens = await self._alone()
            while tokens is None:  # busy: the probe waits for a quiet moment
                if self.state.draining:
                    return
                await asyncio.sleep(IDLE_RETRY_SECONDS)
                tokens = await self._alone()
            self.check(tokens)

    def check(self, tokens: list[int]) -> None:
        self.runs += 1
        if tokens == self.expected:
            if self.health.probe_error is not None:
                log.warning("inference probe passes again")
            self.health.probe_error = None
            return
        self.health.probe_error = f"inference probe produced {tokens}, expected {self.expected}"
        log.error("%s: the model no longer computes what it did at start-up; not ready",
                  self.health.probe_error)

    async def _alone(self) -> list[int] | None:
        """The probe's tokens, or None if other requests ran meanwhile (or the engine was busy)."""
        engine = self.engine
        if engine.open_requests or not engine.alive or self.state.draining:
            return None  # (a draining server runs what it has, and nothing new)
        submitted = engine.submitted
        # NOTE: past the door on purpose: the probe is the server's own, never refused or counted
        request = EngineRequest(engine.new_group_id(), self._prompt, self._params,
                                engine.limits.policy.default_class)
        stream = engine.submit(request)
        tokens: list[int] = []
        try:
            async for out in stream:
                if out.finish_reason in ("abort", "error"):  # no answer: no comparison
                    return None
                tokens += out.new_token_ids
        finally:
            stream.abort()
        return tokens if engine.submitted == submitted + 1 else None
