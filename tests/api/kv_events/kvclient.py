"""A cache-aware router's side of the KV-event sockets, for the tests: a SUB socket and a DEALER
asking the replay socket, decoding with inferd's wire structures (which the wire test checks
against vLLM's), and the block hash recomputed from docs/fleet.md's formula; and a real server
with events on."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import msgspec
import zmq
from apiserver import MODEL, Server, serve

from inferd.api.kv_events import KVEventPublisher
from inferd.api.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from inferd.api.routing.registry import REGISTRY
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import Settings

END = (-1).to_bytes(8, "big", signed=True)
DECODER = msgspec.msgpack.Decoder(KVEventBatch)
KV = 64 * 2**20
PROMPT = "A cache-aware router sends each prompt where its prefix is already cached. " * 3


def kv_settings(**keys: Any) -> Settings:
    return Settings.model_validate({"kv_events": {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                                                  "replay_endpoint": "tcp://127.0.0.1:0", **keys}})


@asynccontextmanager
async def events_server(weights: tuple, **keys: Any) -> AsyncIterator[tuple[Server, KVEventPublisher]]:
    """A server with [kv_events] on (and `keys`), both sockets on free loopback ports."""
    settings = kv_settings(**keys)
    llm = LLMEngine(*weights, EngineConfig.of(kv_cache_memory=KV).replace(kv_events=settings.kv_events))
    async with serve(llm, settings) as server:
        publisher = server.test_server.app[REGISTRY].kv_events
        assert publisher is not None
        yield server, publisher


async def tokens_of(server: Server, prompt: str, model: str = MODEL) -> list[int]:
    status, reply = await server.post("/tokenize", {"model": model, "prompt": prompt})
    assert status == 200, reply
    return reply["tokens"]


async def complete(server: Server, prompt: str, **extra: Any) -> None:
    status, reply = await server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                          "temperature": 0, **extra})
    assert status == 200, reply


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """docs/fleet.md: blake2b(parent || each token id as int32 little-endian, digest_size=16)."""
    return blake2b(parent + struct.pack(f"<{len(tokens)}i", *tokens), digest_size=16).digest()


def chain(tokens: Sequence[int], block_size: int, root: bytes = b"") -> list[bytes]:
    keys, parent = [], root
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


@dataclass
class Batch:
    topic: bytes
    seq: int
    batch: KVEventBatch

    @property
    def stored(self) -> list[BlockStored]:
        return [e for e in self.batch.events if isinstance(e, BlockStored)]

    @property
    def cleared(self) -> bool:
        return any(isinstance(e, AllBlocksCleared) for e in self.batch.events)

    @property
    def removed(self) -> list[BlockRemoved]:
        return [e for e in self.batch.events if isinstance(e, BlockRemoved)]


def decode(topic: bytes, seq: bytes, payload: bytes) -> Batch:
    assert len(seq) == 8
    return Batch(topic, int.from_bytes(seq, "big"), DECODER.decode(payload))


class Subscriber:
    """A SUB socket on the publisher's endpoint (every topic, or those starting with `topic`)."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.batches: list[Batch] = []

    async def until(self, done: Callable[[list[Batch]], bool], within: float = 20.0) -> list[Batch]:
        """Every batch received so far, once `done(batches)` holds; AssertionError after `within`."""
        deadline = time.monotonic() + within
        while not done(self.batches):
            assert time.monotonic() < deadline, self.batches
            if await asyncio.to_thread(self.socket.poll, 50):
                self.batches.append(decode(*self.socket.recv_multipart()))
        return self.batches

    def close(self) -> None:
        self.context.destroy(linger=0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def replay(endpoint: str, start: int, within: float = 10.0) -> list[Batch]:
    """A DEALER's replay request from `start`: the batches, checked to end with seq -1."""
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        return answer(dealer, within)
    finally:
        context.destroy(linger=0)


def answer(dealer: zmq.Socket, within: float = 10.0) -> list[Batch]:
    """A replay's answer on `dealer`, up to and including its end marker (not returned)."""
    batches = []
    deadline = time.monotonic() + within
    while True:
        assert dealer.poll(max(0, int((deadline - time.monotonic()) * 1000))), "no end of replay"
        empty, topic, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END:
            assert (topic, payload) == (b"", b"")
            return batches
        batches.append(decode(topic, seq, payload))
