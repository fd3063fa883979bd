"""KV-cache events for cache-aware routers, in vLLM's wire format (settings/fleet.py, docs/fleet.md).

    wire.py        the msgspec structures, field for field vLLM's (vllm/distributed/kv_events.py)
    publisher.py   `KVEventPublisher`: a thread with the PUB socket and the ROUTER replay socket;
                   `KVEventSink`, what one engine calls with each step's events
    serving.py     its place in the app: bound at start-up, closed at cleanup; its /metrics

Each engine hands its step's events (engine/kv/events.py) to a sink the registry gives it when it
starts (routing/registry.py); the publisher numbers, encodes and sends them off the event loop.
"""

from inferd.api.kv_events.publisher import KVEventPublisher, KVEventSink
from inferd.api.kv_events.serving import KVEventsCollector, publishing

__all__ = ["KVEventPublisher", "KVEventSink", "KVEventsCollector", "publishing"]
