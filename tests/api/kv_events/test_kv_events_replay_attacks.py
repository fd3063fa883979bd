"""The replay socket under garbage, sent as an attacker would over real TCP: wrong frame counts,
starts of 7 and 9 bytes, a 10 MB frame, thousands of frames, random bytes without the ZeroMQ
handshake, a pickle that would run code if anything unpickled it. The publisher must stay up, count
what reached it, decode none of it, still answer a valid request, and the KV pool stay whole."""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import socket
import tempfile
import time
from pathlib import Path

import pytest
import zmq
from kvclient import PROMPT, answer, complete, events_server, replay

from inferd.api.kv_events import KVEventPublisher
from inferd.api.kv_events.publisher import MAX_REQUEST_BYTES

pytestmark = [pytest.mark.asyncio, pytest.mark.served]


class Payload:
    """Unpickled, it would create `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def short_pickle(marker: Path) -> bytes:
    """A pickle (protocol 0) small enough to pass ZMQ_MAXMSGSIZE that, unpickled, runs `touch marker`."""
    return b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."


def attack(endpoint: str, marker: Path) -> int:
    """Send every malformed request; how many of them are whole messages the publisher reads
    (libzmq drops a peer whose frame is over MAX_REQUEST_BYTES, and raw bytes without the ZMTP
    handshake, before anything is read)."""
    rng = random.Random(46)
    bad = [
        [b"\x00" * 8],  # no empty delimiter: 2 frames at the ROUTER
        [b"", b"\x00" * 8, b"more"],  # 4 frames
        [b""],
        [b"", b"\x00" * 7],
        [b"", b"\x00" * 9],
        [b"", b"x", b"y", b"z", b"w"],
        [b"", pickle.dumps(Payload(marker))],  # (over MAX_REQUEST_BYTES: refused by libzmq)
        [b"", short_pickle(marker)],
        [short_pickle(marker), b"", b"\x00" * 8],
        [bytes(rng.getrandbits(8) for _ in range(rng.randint(9, 60))) for _ in range(3)],
        [b""] * 5000,  # (read frame by frame, kept: 4)
        [b"x", b"\x00" * 8],  # a delimiter that is not empty
    ]
    context = zmq.Context()
    try:
        for frames in bad:
            dealer = context.socket(zmq.DEALER)
            dealer.connect(endpoint)
            dealer.send_multipart(frames)
    finally:
        context.destroy(linger=5000)  # (until each has gone out)
    context = zmq.Context()
    try:
        huge = context.socket(zmq.DEALER)
        huge.connect(endpoint)
        huge.send_multipart([b"", b"\x00" * (10 * 2**20)])  # over ZMQ_MAXMSGSIZE: libzmq drops the peer
        time.sleep(0.5)
    finally:
        context.destroy(linger=0)
    with socket.create_connection(host_port(endpoint)) as raw:  # no ZMTP greeting: refused by libzmq
        raw.sendall(os.urandom(4096) + pickle.dumps(Payload(marker)))
    return sum(all(len(frame) <= MAX_REQUEST_BYTES for frame in frames) for frames in bad)


async def until_counted(publisher: KVEventPublisher, bad: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while publisher.counts.bad_replay_requests < bad:
        assert time.monotonic() < deadline, publisher.counts
        await asyncio.sleep(0.02)


async def test_garbage_on_the_replay_socket_is_counted_and_dropped(served_weights: tuple) -> None:
    marker = Path(tempfile.mkdtemp(prefix="kv")) / "u"  # (short: its pickle must pass ZMQ_MAXMSGSIZE)
    assert len(short_pickle(marker)) <= MAX_REQUEST_BYTES
    async with events_server(served_weights) as (server, publisher):
        await complete(server, PROMPT)
        before = await asyncio.to_thread(replay, publisher.replay_endpoint, 0)
        bad = await asyncio.to_thread(attack, publisher.replay_endpoint, marker)
        await until_counted(publisher, bad)
        await asyncio.sleep(0.1)
        assert publisher.counts.bad_replay_requests == bad and publisher.counts.replay_requests == 1
        await complete(server, PROMPT + " Once more.")  # the engine and the publisher go on
        after = await asyncio.to_thread(replay, publisher.replay_endpoint, 0)
        assert [(b.seq, b.batch) for b in after[:len(before)]] == [(b.seq, b.batch) for b in before]
        assert len(after) > len(before)
        async with server.session.get("/metrics") as r:
            assert f"inferd_kv_events_bad_replay_requests_total {float(bad)}" in await r.text()
        assert not marker.exists()
        marker.parent.rmdir()
    # (serve checked on the way out that no request and no KV block is held)


async def test_a_dealer_that_asks_twice_gets_two_whole_answers(served_weights: tuple) -> None:
    async with events_server(served_weights) as (server, publisher):
        await complete(server, PROMPT)
        context = zmq.Context()
        try:
            dealer = context.socket(zmq.DEALER)
            dealer.connect(publisher.replay_endpoint)
            for start in (0, 1):
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
            first, second = await asyncio.to_thread(answer, dealer), await asyncio.to_thread(answer, dealer)
        finally:
            context.destroy(linger=0)
        assert first and [b.seq for b in second] == [b.seq for b in first][1:]
