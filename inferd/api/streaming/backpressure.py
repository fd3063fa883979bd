"""Slow clients: a stream whose client stops reading holds neither the engine nor memory for long.

    before each write:  the transport below its high-water mark?  yes -> write (the common case)
                        no -> pause the request (its steps skipped, KV kept): nothing is
                              generated ahead of a client that is not reading
                              -> the client reads again: resume
                              -> nothing read for server.slow_client_seconds: abort the request
                                 (its KV blocks freed at the next step), count it, drop the
                                 connection

What one stream holds is bounded by its buffers, set when the stream opens: the transport's
high-water mark (server.stream_send_buffer_bytes) and the kernel's, where SO_SNDBUF caps the
socket and TCP_NOTSENT_LOWAT keeps what the client's window has not taken small. A client that
never reads is found once these and its own receive window are full, and no sooner: until then
nothing tells it from one that reads.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from inferd.engine.async_engine import RequestStream

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how often a blocked writer looks again (only while its client is behind)
# bytes the kernel takes beyond what the client's window holds: the rest waits in the transport,
# where the high-water mark sees it
NOTSENT_LOWAT = 1024


@dataclass
class SlowClientCounts:
    """Streams whose client fell behind (event loop only)."""

    paused: int = 0  # requests paused while their client did not read
    cut: int = 0  # requests aborted because it still did not


SLOW_CLIENTS = web.AppKey("slow_clients", SlowClientCounts)


class ClientTooSlow(ConnectionResetError):
    """The client read nothing for server.slow_client_seconds: the stream is cut."""


def bound_send_buffer(request: web.Request, size: int) -> None:
    """Cap what the stream's socket and transport hold for a client that does not read: the
    kernel's send buffer, and the transport's high-water mark, above which writing waits (and
    this module decides). 0: leave both at their defaults (megabytes; 64 KiB)."""
    transport = request.transport
    if not size or transport is None:
        return
    transport.set_write_buffer_limits(high=size)
    sock = transport.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            if hasattr(socket, "TCP_NOTSENT_LOWAT"):  # (Linux, macOS)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
    except OSError as e:  # (not a TCP socket, e.g. a Unix one in some set-up): keep the default
        log.debug("SO_SNDBUF not set: %s", e)


def client_behind(request: web.Request) -> bool:
    """The transport holds more than its high-water mark: the next write would wait for the client."""
    protocol = request.protocol
    return protocol is not None and protocol.writing_paused


async def wait_for_reader(request: web.Request, streams: Sequence[RequestStream], seconds: float,
                          counts: SlowClientCounts) -> None:
    """Pause the streams until the client reads again; after `seconds` without it, abort them and
    raise ClientTooSlow (the caller's cleanup frees the rest)."""
    start, paused = time.monotonic(), False
    try:
        while client_behind(request):
            waited = time.monotonic() - start
            if waited > seconds:
                for stream in streams:
                    stream.abort()
                counts.cut += 1
                log.warning("%s: the client read nothing for %.0f s: stream cut", request.path, waited)
                if request.transport is not None:
                    request.transport.abort()  # (drops what its buffers hold)
                raise ClientTooSlow(f"the client read nothing for {waited:.0f} s")
            if not paused:
                paused = True
                counts.paused += 1
                for stream in streams:
                    stream.pause()
            await asyncio.sleep(POLL_SECONDS)
    finally:
        if paused:
            for stream in streams:
                stream.pause(False)  # (ignored once aborted or finished)
