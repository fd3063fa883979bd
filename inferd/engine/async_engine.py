"""The engine loop: an `LLMEngine` owned by one dedicated thread, fed from the event loop.

    event loop (front door)                    engine thread (sole owner of scheduler + requests)
    -----------------------                    ---------------------------------------------------
    submit(EngineRequest) --> inbox ---------> drain inbox: add_request / abort
    stream.abort()        --> inbox (Abort)    step(): schedule, forward, sample, detokenize
    RequestStream        <-- call_soon_threadsafe <-- StepOutputs, one callback per step
    snapshot             <-- published every STATS_INTERVAL_SECONDS and before a finish is delivered
                             (an immutable EngineSnapshot)

The forward runs on the engine thread, so HTTP stays responsive while a step runs. Requests and
aborts cross over through a deque (appends are atomic) and a wake-up event. An abort takes
effect at the start of the next step, and returns the request's blocks there. This module
imports no torch: the API holds the engine through this face only.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from inferd.engine.protocol import (
    TOKEN_BUCKETS,
    EngineCore,
    EngineDeadError,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSnapshot,
    Histogram,
    StepOutputs,
)

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.005  # how soon the loop looks again when work waits but none could run
STATS_INTERVAL_SECONDS = 0.05  # how often a busy engine publishes its snapshot
HEARTBEAT_SECONDS = 1.0  # the longest an idle engine loop sleeps between beats


@dataclass(frozen=True, slots=True)
class Abort:
    group_id: int


@dataclass(frozen=True, slots=True)
class Pause:
    group_id: int
    paused: bool  # False: resume


class RequestStream:
    """The outputs of one submitted group (all its n choices), in order, on the event loop.

    It is the one tracker of which choices are still open. `on_queue_exit` (the door's) is
    called once, when the group leaves the waiting queue: first scheduled, or ended before.
    """

    def __init__(self, engine: AsyncEngine, group_id: int, n: int,
                 on_queue_exit: Callable[[], None] | None = None) -> None:
        self._engine = engine
        self.group_id = group_id
        self.n = n
        self._items: deque[EngineOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None  # set while a reader waits for items
        self.open_choices = set(range(n))  # choices without a finished output yet
        self.aborted = False
        self._on_queue_exit = on_queue_exit

    @property
    def finished(self) -> bool:
        return not self.open_choices

    def _left_queue(self) -> None:
        callback, self._on_queue_exit = self._on_queue_exit, None
        if callback is not None:
            callback()

    def _put(self, output: EngineOutput) -> None:
        if output.index not in self.open_choices:
            return  # (a choice ends once)
        if output.finished:
            self.open_choices.discard(output.index)
            if self.finished:
                self._left_queue()
        self._items.append(output)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get_batch(self, timeout: float | None = None) -> list[EngineOutput]:
        """Every output queued now, waiting up to `timeout` seconds for the first one ([] then).

        If the engine stops, each open choice gets a final output with finish_reason "abort"
        and the reason in stop_reason.
        """
        await self._wait(timeout)
        items = list(self._items)
        self._items.clear()
        return items

    async def get(self) -> EngineOutput:
        """The next output of any choice."""
        while not self._items:
            await self._wait(None)
        return self._items.popleft()

    async def _wait(self, timeout: float | None) -> None:
        """Until an item is queued or `timeout` seconds pass."""
        # NOTE: a bare future and one timer per wait, not asyncio.Queue + asyncio.timeout: this
        # runs once per token per stream, and those cost ~3x more on the event loop.
        if self._items:
            return
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def __aiter__(self) -> AsyncIterator[EngineOutput]:
        while not (self.finished and not self._items):
            for output in await self.get_batch():
                yield output

    def pause(self, paused: bool = True) -> None:
        """Skip (or, with False, resume) the group's steps, its KV blocks kept: its reader is
        behind (a slow client). Ignored once it finished."""
        if not self.finished and not self.aborted:
            self._engine._pause(self.group_id, paused)

    def abort(self) -> None:
        """Cancel the group (client gone, stream closed); idempotent, safe after it finished."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self._left_queue()
            self._engine._abort(self.group_id)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class AsyncEngine:
    """The engine's public face: submit, abort (through the stream), outputs, the snapshot."""

    def __init__(self, engine: EngineCore) -> None:
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.limits: EngineLimits = engine.limits
        self._inbox: deque[EngineRequest | Abort | Pause] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[int, RequestStream] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._group_ids = itertools.count()
        self.submitted = 0  # groups submitted so far (the inference probe checks it ran alone)
        # called on the event loop after each step that computed prompt tokens: (tokens, seconds)
        self.prefill_listener: Callable[[int, float], None] | None = None
        # the engine thread's pulse: when its loop last went round, and a hook it calls each
        # time (the systemd watchdog); a step that hangs stops both
        self.last_beat = time.monotonic()
        self.heartbeat: Callable[[], None] | None = None
        # ([kv_events] on) called on the engine thread with each step's KV events, if it has any
        # (engine/kv/events.py): the registry sets it when the engine starts serving (api/kv_events/)
        self.kv_event_sink: Callable[[Sequence[Any]], None] | None = None
        self.throughput = Throughput()  # sampled with every snapshot; rates read at any time
        self._step_seconds = Histogram()  # written by the engine thread, copied into snapshots
        self._batch_tokens = Histogram(TOKEN_BUCKETS)
        self._steps = 0
        self.snapshot_time = 0.0  # perf_counter() of the last publication
        self.snapshot: EngineSnapshot = self._publish(0.0)

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort everything still running and join the engine thread."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    async def sleep(self) -> int:
        """Sleep, level 1, once stopped: the core frees its KV cache (in a worker thread) and keeps
        its weights; the bytes freed. `wake` builds it again; `start` then runs the engine again."""
        assert self._thread is None, "stop the engine before it sleeps"
        return await asyncio.get_running_loop().run_in_executor(None, self._engine.release_kv)

    async def wake(self) -> None:
        """Back from sleep: the core's KV cache, scheduler and runner built again, as at start (in
        a thread that then ends: builder.in_passing_thread says why); its limits read again (the
        door of the revision that serves next)."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-wake") as passing:
            await asyncio.get_running_loop().run_in_executor(passing, self._engine.restore_kv)
        self.limits = self._engine.limits
        self.snapshot = self._publish(0.0)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def open_requests(self) -> int:
        """Submitted groups whose outputs are still being read (event-loop side)."""
        return len(self._streams)

    # ------------------------------------------------------------------- event-loop side

    def new_group_id(self) -> int:
        return next(self._group_ids)

    def submit(self, request: EngineRequest, on_queue_exit: Callable[[], None] | None = None) -> RequestStream:
        """Queue a checked request; raises EngineDeadError at once if the engine is not running."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        # the stream exists before any output does: outputs come back on this loop
        stream = RequestStream(self, request.group_id, request.n, on_queue_exit)
        self._streams[request.group_id] = stream
        self.submitted += 1
        self._inbox.append(request)
        self._wakeup.set()
        return stream

    def _abort(self, group_id: int) -> None:
        self._streams.pop(group_id, None)  # nobody reads its outputs any more
        self._inbox.append(Abort(group_id))
        self._wakeup.set()

    def _pause(self, group_id: int, paused: bool) -> None:
        self._inbox.append(Pause(group_id, paused))
        self._wakeup.set()

    def _deliver(self, step: StepOutputs) -> None:
        for group_id in step.started:
            stream = self._streams.get(group_id)
            if stream is not None:
                stream._left_queue()
        if step.prefill_tokens and self.prefill_listener is not None:
            self.prefill_listener(step.prefill_tokens, step.step_seconds)
        for out in step.outputs:
            stream = self._streams.get(out.group_id)
            if stream is None:
                continue
            stream._put(out)
            if stream.finished:
                del self._streams[stream.group_id]

    def _fail(self, message: str, group_ids: list[int] | None = None) -> None:
        """End streams (all of them by default) with an abort carrying `message`."""
        for group_id in list(self._streams) if group_ids is None else group_ids:
            stream = self._streams.pop(group_id, None)
            for index in sorted(stream.open_choices) if stream else ():
                stream._put(EngineOutput(group_id, [], "", index=index, finished=True,
                                         finish_reason="abort", stop_reason=message))

    # ---------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._take_inbox()
                self.last_beat = time.monotonic()
                if self.heartbeat is not None:
                    self.heartbeat()
                if not self._engine.has_work():
                    self.snapshot = self._publish(0.0)  # e.g. blocks an abort freed
                    self._wakeup.wait(HEARTBEAT_SECONDS)  # (bounded: an idle loop still beats)
                    self._wakeup.clear()
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001 - a dead engine must fail its streams, not hang them
            log.exception("the engine loop failed")
            self._stopping = True
            self._inbox.clear()
            self._loop.call_soon_threadsafe(self._fail, f"engine failure: {e}")  # type: ignore[union-attr]
            return
        self._inbox.clear()
        for group_id in self._engine.group_ids():
            self._engine.abort(group_id)
        self.snapshot = self._publish(0.0)
        self._loop.call_soon_threadsafe(self._fail, "the server is shutting down")  # type: ignore[union-attr]

    def _take_inbox(self) -> None:
        engine = self._engine
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, Abort):
                engine.abort(item.group_id)
                continue
            if isinstance(item, Pause):
                engine.pause(item.group_id, item.paused)
                continue
            try:
                engine.add_request(item)
            except (AssertionError, ValueError) as e:  # the door let through what it must not: fail it alone
                log.error("request %d refused by the engine: %s", item.group_id, e)
                self._loop.call_soon_threadsafe(self._fail, str(e), [item.group_id])  # type: ignore[union-attr]

    def _step(self) -> None:
        engine = self._engine
        start = time.perf_counter()
        step = engine.step()
        end = time.perf_counter()
        self._steps += 1
        if engine.last_step_tokens:
            self._step_seconds.observe(end - start)
            self._batch_tokens.observe(engine.last_step_tokens)
        # O(requests): not every step; but before a finish is delivered, so that a client holding
        # its answer finds it counted in /v1/status and /metrics
        if step.kv_events and (sink := self.kv_event_sink) is not None:  # (before the outputs they precede)
            sink(step.kv_events)
        if end - self.snapshot_time >= STATS_INTERVAL_SECONDS or any(o.finished for o in step.outputs):
            self.snapshot = self._publish(end - start)
        if step.outputs or step.started or step.prefill_tokens:
            self._loop.call_soon_threadsafe(self._deliver, step)  # type: ignore[union-attr]
        if not engine.last_step_tokens:
            # work is waiting but none can run now (e.g. load shedding holds it back): look
            # again soon, for timeouts and freed room, without spinning
            self._wakeup.wait(IDLE_POLL_SECONDS)
            self._wakeup.clear()

    def _publish(self, step_seconds: float) -> EngineSnapshot:
        self.snapshot_time = time.perf_counter()
        snapshot = self._engine.snapshot(self._steps, step_seconds, self._step_seconds.copy(),
                                         self._batch_tokens.copy())
        classes = snapshot.classes
        self.throughput.sample(time.monotonic(), sum(c.generation_tokens for c in classes),
                               sum(c.prompt_tokens for c in classes))
        return snapshot


class Throughput:
    """Tokens per second, recent and per second over the last minute, from cumulative counts
    that the engine thread samples as it publishes its stats; read from any thread."""

    HISTORY_SECONDS = 60
    RESOLUTION = 0.25  # seconds between kept samples

    def __init__(self) -> None:
        # (time, generation tokens, prompt tokens) so far; at most one per RESOLUTION
        self._samples: deque[tuple[float, int, int]] = deque(
            maxlen=int((self.HISTORY_SECONDS + 2) / self.RESOLUTION))

    def sample(self, now: float, generation_tokens: int, prompt_tokens: int) -> None:
        if self._samples and now - self._samples[-1][0] < self.RESOLUTION:
            self._samples[-1] = (self._samples[-1][0], generation_tokens, prompt_tokens)
        else:
            self._samples.append((now, generation_tokens, prompt_tokens))

    def _at(self, samples: list[tuple[float, int, int]], t: float) -> tuple[int, int]:
        """The counts as of time t: the newest sample at or before it (0 before any)."""
        i = bisect.bisect_right(samples, t, key=lambda s: s[0])
        return (samples[i - 1][1], samples[i - 1][2]) if i else (0, 0)

    def rates(self, now: float, window: float = 10.0) -> tuple[float, float]:
        """(generation, prompt) tokens per second over the last `window` seconds."""
        samples = list(self._samples)  # (a copy: the engine thread appends meanwhile)
        if not samples:
            return 0.0, 0.0
        start = max(now - window, samples[0][0])
        if now <= start:
            return 0.0, 0.0
        (g0, p0), (g1, p1) = self._at(samples, start), self._at(samples, now)
        return (g1 - g0) / (now - start), (p1 - p0) / (now - start)

    def history(self, now: float) -> list[float]:
        """Generation tokens in each of the last 60 whole seconds, oldest first."""
        samples = list(self._samples)
        counts = [self._at(samples, now - k)[0] for k in range(self.HISTORY_SECONDS, -1, -1)]
        return [float(b - a) for a, b in zip(counts, counts[1:])]
