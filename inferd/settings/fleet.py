"""[kv_events]: the KV-cache events cache-aware routers read (llm-d, Dynamo, Ray Serve's
KVAwareRouter, the vLLM router's kv_aware policy), in vLLM's wire format and under vLLM's keys
(its `--kv-events-config`), so a router built for vLLM subscribes to inferd unchanged.

    [kv_events]
    enable_kv_cache_events = true
    endpoint = "tcp://127.0.0.1:5557"          PUB: [topic, seq (8 bytes, big-endian), msgpack batch]
    replay_endpoint = "tcp://127.0.0.1:5558"   ROUTER: [b"", start seq (8 bytes)] -> the batches since

api/kv_events/ publishes; docs/fleet.md documents the block hash a router recomputes.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field, model_validator

from inferd.settings.values import Section

_ENDPOINT = re.compile(r"(tcp://\S+:\d+|ipc://\S+|inproc://\S+)")


class KVEventsSettings(Section):
    """KV-cache events for cache-aware routers (vLLM's --kv-events-config keys)."""

    enable_kv_cache_events: bool = False
    """Publish an event for every block stored in or removed from the prefix cache."""
    publisher: Literal["null", "zmq"] | None = None
    """"zmq": a ZeroMQ PUB socket; "null": none; unset: "zmq" when enabled."""
    endpoint: str = "tcp://127.0.0.1:5557"
    """The PUB socket's address; inferd binds it whatever address it names (loopback by default)."""
    replay_endpoint: str | None = None
    """A ROUTER socket's address that answers a start sequence number with the buffered batches; unset: none."""
    buffer_steps: int = Field(default=10_000, ge=1)
    """Batches kept for replay."""
    hwm: int = Field(default=100_000, ge=0)
    """The PUB socket's high-water mark: batches queued per subscriber before it drops them."""
    max_queue_size: int = Field(default=100_000, ge=1)
    """Batches waiting for the publisher thread; more are dropped (counted)."""
    topic: str = ""
    """Every batch's topic frame (with several models: this, then the model's name)."""
    tenant_token_ids: bool = False
    """Publish the token ids of blocks in a tenant's or a cache_salt's namespace; off: their token_ids
    are empty (their hashes and namespace still go out)."""

    @model_validator(mode="after")
    def _resolved(self) -> KVEventsSettings:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not _ENDPOINT.fullmatch(value):
                raise ValueError(f"kv_events.{name} {value!r}: tcp://HOST:PORT, ipc://PATH or inproc://NAME")
        return self

    @property
    def enabled(self) -> bool:
        """Events are recorded and published: enabled, and the publisher zmq (or unset)."""
        return self.enable_kv_cache_events and self.publisher in (None, "zmq")


def parse_kv_events_config(text: str) -> dict[str, Any]:
    """vLLM's --kv-events-config: a JSON object of the [kv_events] keys; ValueError otherwise."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--kv-events-config: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("--kv-events-config: a JSON object of [kv_events] keys")
    return value
