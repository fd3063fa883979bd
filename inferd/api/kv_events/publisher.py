"""`KVEventPublisher`: one thread that owns the ZeroMQ sockets (a socket is not thread-safe), fed
through a bounded queue by the engines' threads and the event loop.

    engine thread: sink(events) --put_nowait--> queue --> publisher thread: seq = 0, 1, 2, ...
    (queue full: the batch is dropped, counted)            PUB  [topic, seq (8 bytes, big-endian), msgpack batch]
                                                           buffer: the last buffer_steps batches
    router's DEALER: [b"", start (8 bytes, big-endian)] -> ROUTER  [id, b"", topic, seq, batch] per buffered
                                                                   batch from `start`, then
                                                                   [id, b"", b"", -1 (8 bytes, signed), b""]

inferd binds both addresses, whatever they name (vLLM connects its PUB to a non-wildcard one;
inferd does not): the routers connect. The replay socket takes exactly that 8-byte request:
anything else is dropped and counted, nothing read from a socket is ever decoded (no msgpack, no
pickle), and libzmq refuses a frame over MAX_REQUEST_BYTES (ZMQ_MAXMSGSIZE: it disconnects the
peer) before it is read.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from inferd.api.kv_events.wire import AllBlocksCleared, KVCacheEvent, batch, from_engine
from inferd.settings.fleet import KVEventsSettings

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02  # the longest a replay request waits while no batch comes
MAX_REQUEST_BYTES = 64  # a replay request's largest frame (it is 8 bytes); libzmq drops a peer over it
MAX_REQUEST_FRAMES = 3  # frames of a request kept for the check; the rest are read and dropped
REPLAYS_PER_ROUND = 16  # replay messages answered between two batches at most (a flood waits its turn)
LINGER_MS = 500  # at close, how long queued messages may still go out
CLOSE_SECONDS = 2.0  # how long close() waits for the thread to send what is queued
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the end of a replay

_STOP = object()


@dataclass
class KVEventCounts:
    """Counters for /metrics (inferd_kv_events_*): written by the publisher thread (and by the
    engines' threads for drops, under the publisher's lock)."""

    published: int = 0  # batches sent on the PUB socket
    dropped: int = 0  # batches dropped: the queue was full
    replay_requests: int = 0  # valid replay requests answered
    bad_replay_requests: int = 0  # messages on the replay socket that were not one, dropped unread


class KVEventSink:
    """What one engine calls with each step's events (on its thread); `close` makes it drop them,
    once any call in progress has handed its batch over (so nothing follows a cleared cache)."""

    def __init__(self, publisher: KVEventPublisher, topic: bytes) -> None:
        self._publisher = publisher
        self._topic = topic
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, events: Sequence[Any]) -> None:
        with self._lock:
            if not self._closed:
                self._publisher.put(self._topic, events)

    def close(self) -> None:
        with self._lock:
            self._closed = True


class KVEventPublisher:
    """Numbers, encodes and publishes the engines' KV events in vLLM's wire format (module docstring)."""

    def __init__(self, settings: KVEventsSettings) -> None:
        self.settings = settings
        self.counts = KVEventCounts()
        self.endpoint = settings.endpoint  # the bound addresses (a port 0 resolved) once started
        self.replay_endpoint = settings.replay_endpoint
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.max_queue_size)
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=settings.buffer_steps)  # (seq, topic, payload)
        self._lock = threading.Lock()  # (the drop counter, from any thread)
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._stopping = False

    @property
    def queued(self) -> int:
        """Batches waiting for the publisher thread."""
        return self._queue.qsize()

    # ---- any thread ----

    def topic(self, model: str, several: bool) -> bytes:
        """A model's topic frame: [kv_events] topic, followed by the model's name on a server of several."""
        return (self.settings.topic + (model if several else "")).encode()

    def sink(self, model: str, several: bool) -> KVEventSink:
        return KVEventSink(self, self.topic(model, several))

    def cleared(self, model: str, several: bool) -> None:
        """The model's engine stopped, or a new revision took over: its cached blocks are gone."""
        self.put(self.topic(model, several), [AllBlocksCleared()])

    def put(self, topic: bytes, events: Sequence[Any]) -> None:
        """Queue a batch (engine events or wire events), never blocking; dropped, counted, when full."""
        try:
            self._queue.put_nowait((topic, events))
        except queue.Full:
            with self._lock:
                self.counts.dropped += 1

    # ---- lifecycle (the event loop) ----

    def start(self) -> None:
        """Bind the sockets (in the publisher thread, which owns them) and start publishing;
        OSError naming the address if a bind fails."""
        self._thread = threading.Thread(target=self._run, name="inferd-kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            self._thread.join()
            message = self._failure.strerror if isinstance(self._failure, OSError) else str(self._failure)
            raise OSError(f"[kv_events]: {message}")
        log.info("kv events: publishing on %s%s", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def close(self) -> None:
        """Send what is queued (for up to CLOSE_SECONDS), then close the sockets."""
        self._stopping = True
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass  # (the thread stops once the queue is empty)
        if self._thread is not None:
            self._thread.join(CLOSE_SECONDS)

    # ---- the publisher thread ----

    def _run(self) -> None:
        context = zmq.Context()
        try:
            pub, replay = self._open(context)
        except (zmq.ZMQError, OSError) as e:
            self._failure = e
            self._started.set()
            context.destroy(linger=0)
            return
        self._started.set()
        try:
            self._loop(pub, replay)
        finally:
            context.destroy(linger=LINGER_MS)

    def _open(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
        pub.setsockopt(zmq.LINGER, LINGER_MS)
        self.endpoint = _bind(pub, self.settings.endpoint, "endpoint")
        replay = None
        if self.settings.replay_endpoint is not None:
            replay = context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            # a whole replay and its end marker fit in a peer's queue (the frames are the buffer's own bytes)
            replay.setsockopt(zmq.SNDHWM, self.settings.buffer_steps + 1)
            replay.setsockopt(zmq.LINGER, LINGER_MS)
            self.replay_endpoint = _bind(replay, self.settings.replay_endpoint, "replay_endpoint")
        return pub, replay

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        encode = msgspec.msgpack.Encoder().encode
        numbers = itertools.count()
        while True:
            for _ in range(REPLAYS_PER_ROUND if replay is not None else 0):
                if not replay.poll(0):  # type: ignore[union-attr]
                    break
                try:
                    self._serve_replay(replay)  # type: ignore[arg-type]
                except Exception:  # noqa: BLE001 - a replay is best effort: the thread goes on
                    log.exception("kv events: a replay request failed")
            try:
                item = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._stopping:
                    return
                continue
            if item is _STOP:
                return
            topic, events = item
            try:
                payload = encode(batch([e if isinstance(e, KVCacheEvent) else from_engine(e) for e in events]))
            except Exception:  # noqa: BLE001 - a bug: never stop publishing over one batch
                log.exception("kv events: a batch could not be encoded")
                continue
            seq = next(numbers)
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), copy=False)
            self._buffer.append((seq, topic, payload))
            self.counts.published += 1

    def _serve_replay(self, replay: zmq.Socket) -> None:
        """Answer one message on the replay socket, if it is a replay request (module docstring)."""
        frames = _read_message(replay)
        if len(frames) != MAX_REQUEST_FRAMES or frames[1] != b"" or len(frames[2]) != 8:
            self.counts.bad_replay_requests += 1
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        self.counts.replay_requests += 1
        for seq, topic, payload in self._buffer:  # (a ROUTER drops what a gone peer cannot take)
            if seq >= start:
                replay.send_multipart((identity, b"", topic, seq.to_bytes(8, "big"), payload), copy=False)
        replay.send_multipart((identity, b"", b"", END_SEQ, b""))


def _bind(socket: zmq.Socket, address: str, key: str) -> str:
    """Bind `address`; the address bound (a tcp port 0 resolved). OSError naming the key otherwise."""
    try:
        socket.bind(address)
    except zmq.ZMQError as e:
        raise OSError(e.errno, f"cannot bind {key} {address}: {os.strerror(e.errno)}") from None
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


def _read_message(socket: zmq.Socket) -> list[bytes]:
    """One whole message's first MAX_REQUEST_FRAMES + 1 frames; the rest are read and dropped."""
    frames: list[bytes] = []
    while True:
        frame = socket.recv(copy=True)
        if len(frames) <= MAX_REQUEST_FRAMES:
            frames.append(frame)
        if not socket.getsockopt(zmq.RCVMORE):
            return frames

