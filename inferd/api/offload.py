"""Per-request work that grows with the input, kept off the event loop.

One loop serves every client: a request that tokenizes 8 MB of text (or parses, renders or
encodes as much) in place stalls every stream's next chunk and /health for as long. Work on
an input past OFFLOAD_BYTES runs on a worker thread instead, at most WORKERS at once (more
wait their turn, rather than multiply): the loop goes on meanwhile wherever the work lets go
of the GIL, which the tokenizer does (model/tokenizer.py encodes long texts in a batch call for
that), and Python code does every few milliseconds.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from aiohttp import web

T = TypeVar("T")

OFFLOAD_BYTES = 64 * 1024  # smaller inputs: done in place (cheaper than a thread's round trip)
WORKERS = 2


class Offload:
    """A bounded set of worker threads for big inputs (one per app, made on its loop)."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._slots = asyncio.Semaphore(workers)

    async def run(self, size: int, work: Callable[[], T]) -> T:
        """`work()`, in place for an input of `size` bytes below OFFLOAD_BYTES, else on a worker."""
        if size < OFFLOAD_BYTES:
            return work()
        async with self._slots:
            return await asyncio.to_thread(work)


OFFLOAD = web.AppKey("offload", Offload)


def prestarted_pool(workers: int = min(32, (os.cpu_count() or 1) + 4)) -> ThreadPoolExecutor:
    """A thread pool whose `workers` threads all exist from the start: the event loop's default
    executor (`asyncio.to_thread`, `run_in_executor(None, ...)`), asyncio's default size. One that
    grows on demand adds a thread the first time that many pieces of work overlap, minutes or
    hours in, which a count of the server's threads cannot tell from a leak."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix="inferd-worker")
    started = threading.Barrier(workers)  # each submit finds every thread so far waiting: a new one
    for _ in range(workers):
        pool.submit(started.wait)
    return pool
