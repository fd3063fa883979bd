"""Server-sent events by hand, and the batching of engine outputs that feeds them.

    engine thread --step--> RequestStream queues --OutputQueue.next_batch()--> [(prompt, output), ...]
                                                         one write() per batch <--'

A step delivers the outputs of every request at once; when the HTTP side falls behind, several
outputs wait in a stream's queue. `next_batch` takes all of them, so the handler writes one
chunk of events per wake-up instead of one per token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from inferd.engine.async_engine import RequestStream
from inferd.engine.protocol import EngineOutput

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}
KEEPALIVE = b": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


def dumps(payload: Any) -> str:
    """Compact JSON for the hot path (plain dicts, stdlib json)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


class EventStream:
    """An SSE response: numbered `data:` events, buffered until `flush()` writes them at once."""

    def __init__(self) -> None:
        self.response = web.StreamResponse(headers=SSE_HEADERS)
        self._next_id = 0
        self._pending: list[str] = []

    async def open(self, request: web.Request) -> None:
        self.response.enable_chunked_encoding()
        await self.response.prepare(request)

    def add(self, payload: dict[str, Any] | str) -> None:
        """One event; a str payload is JSON already (the per-token fast path)."""
        data = payload if isinstance(payload, str) else dumps(payload)
        self._pending.append(f"id: {self._next_id}\ndata: {data}\n\n")
        self._next_id += 1

    async def flush(self) -> None:
        """Write what was added in one write(); raises ConnectionResetError if the client left."""
        if self._pending:
            data = "".join(self._pending).encode()
            self._pending.clear()
            await self.response.write(data)

    async def keepalive(self) -> None:
        await self.response.write(KEEPALIVE)

    async def close(self) -> None:
        """Flush, then `data: [DONE]` and the end of the body."""
        self._pending.append(DONE)
        await self.flush()
        await self.response.write_eof()


class OutputQueue:
    """The outputs of one HTTP request's engine requests (one per prompt), in batches.

    `done` once the final output of every choice has been taken (each stream, the one tracker
    of its choices, delivers exactly one final output per choice).
    """

    def __init__(self, streams: Sequence[RequestStream]) -> None:
        self._streams = list(streams)
        self._unfinished = sum(s.n for s in self._streams)  # final outputs not taken yet
        self._merged: asyncio.Queue[tuple[int, EngineOutput]] | None = None
        self._forwarders: list[asyncio.Task[None]] = []
        if len(self._streams) > 1:
            # NOTE: one forwarding task per prompt; the single-prompt case reads its stream directly
            self._merged = asyncio.Queue()
            self._forwarders = [asyncio.ensure_future(self._forward(p, s)) for p, s in enumerate(streams)]

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    async def _forward(self, prompt: int, stream: RequestStream) -> None:
        assert self._merged is not None
        while True:
            self._merged.put_nowait((prompt, await stream.get()))

    async def next_batch(self, timeout: float | None) -> list[tuple[int, EngineOutput]]:
        """Wait for at least one output and take everything queued; [] after `timeout` seconds
        without any (time for a keep-alive)."""
        batch: list[tuple[int, EngineOutput]] = []
        if self._merged is None:  # the common case, kept cheap: it runs per token per stream
            for out in await self._streams[0].get_batch(timeout):
                self._take(batch, 0, out)
            return batch
        try:
            async with asyncio.timeout(timeout):
                self._take(batch, *await self._merged.get())
                while not self._merged.empty():
                    self._take(batch, *self._merged.get_nowait())
        except TimeoutError:
            pass
        return batch

    def _take(self, batch: list[tuple[int, EngineOutput]], prompt: int, out: EngineOutput) -> None:
        self._unfinished -= out.finished
        batch.append((prompt, out))

    def close(self) -> None:
        for task in self._forwarders:
            task.cancel()
