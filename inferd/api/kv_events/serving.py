"""The publisher in the server: bound before the models start, closed after they stop (their
AllBlocksCleared go out first), and its counters in /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.api.kv_events.publisher import KVEventPublisher


def publishing(publisher: KVEventPublisher) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context: bind and start at start-up (a bind that fails, fails the start-up,
    OSError naming the address), send what is queued and close at cleanup. Put it before the
    models' own, so that it starts first and closes last."""

    async def context(app: web.Application) -> AsyncIterator[None]:
        publisher.start()  # (a bind is quick: on the loop)
        yield
        await asyncio.get_running_loop().run_in_executor(None, publisher.close)

    return context


class KVEventsCollector(Collector):
    """/metrics: inferd_kv_events_* (api/kv_events/publisher.py's counts)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        counts = self.publisher.counts
        for name, doc, value in (
            ("published_batches", "KV event batches published (one per engine step with events, and per "
                                  "AllBlocksCleared).", counts.published),
            ("dropped_batches", "KV event batches dropped: the publisher's queue ([kv_events] max_queue_size) "
                                "was full.", counts.dropped),
            ("replay_requests", "Replay requests answered on [kv_events] replay_endpoint.", counts.replay_requests),
            ("bad_replay_requests", "Messages on the replay socket that were no replay request (dropped, "
                                    "never decoded).", counts.bad_replay_requests),
        ):
            yield CounterMetricFamily(f"inferd_kv_events_{name}", doc, value=value)
        yield GaugeMetricFamily("inferd_kv_events_queued_batches", "KV event batches waiting for the publisher "
                                "thread.", value=self.publisher.queued)
