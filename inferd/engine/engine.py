"""The engine loop: an `LLMEngine` owned by one dedicated thread, fed from the event loop.

    event loop (HTTP)                          engine thread (sole owner of scheduler + requests)
    -----------------                          ---------------------------------------------------
    submit() --check--> inbox.append(add) ---> drain inbox: add / abort
    stream.abort()  --> inbox.append(abort)    step(): schedule, forward, sample, detokenize
    stream.get()    <-- call_soon_threadsafe <-- outputs of the step, one batch per step

The forward runs on the engine thread, so HTTP stays responsive while a step runs. Requests
and aborts cross over through a deque (appends are atomic) and a wake-up event; outputs come
back as one callback per step that fans them out to per-request asyncio queues. An abort takes
effect at the start of the next step, and returns the request's blocks there.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from inferd.engine.accounting import TOKEN_BUCKETS, ClassSnapshot, Histogram, RequestSnapshot, Throughput
from inferd.engine.llm_engine import LLMEngine, RequestOutput
from inferd.engine.policy import PriorityClass, Timeouts
from inferd.model.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.005  # how soon the loop looks again when work waits but none could run
STATS_INTERVAL_SECONDS = 0.05  # how often a busy engine publishes its EngineStats
STATUS_REQUESTS = 100  # requests listed in a snapshot at most
HEARTBEAT_SECONDS = 1.0  # the longest an idle engine loop sleeps between beats


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step (read from any thread)."""

    kv_blocks_total: int
    kv_blocks_used: int  # held by requests
    kv_blocks_cached: int  # prefix-cache blocks no request holds (evictable, so free in effect)
    running: int
    waiting: int
    steps: int
    preemptions: dict[str, int]  # by mode
    timeouts: dict[str, int]  # by kind
    rejections: dict[str, int]  # at the door, by reason
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which found
    shed_level: int
    shed_actions: dict[str, int]  # load shedder transitions: "escalate", "recover", "level:N"
    last_step_seconds: float
    classes: tuple[ClassSnapshot, ...]  # most important first
    requests: tuple[RequestSnapshot, ...]  # running first, at most STATUS_REQUESTS
    step_seconds: Histogram  # (copies) the duration of each engine step
    batch_tokens: Histogram  # and the tokens it computed


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed); no new request can run."""


class RequestStream:
    """The outputs of one submitted request (all its n choices), in order, on the event loop."""

    def __init__(self, engine: AsyncEngine, request_id: int, n: int) -> None:
        self._engine = engine
        self.request_id = request_id
        self.n = n
        self._items: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None  # set while a reader waits for items
        self.open_choices = set(range(n))  # choices without a finished output yet
        self.aborted = False

    @property
    def finished(self) -> bool:
        return not self.open_choices

    def _put(self, output: RequestOutput) -> None:
        if output.finished:
            self.open_choices.discard(output.index)
        self._items.append(output)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get_batch(self, timeout: float | None = None) -> list[RequestOutput]:
        """Every output queued now, waiting up to `timeout` seconds for the first one ([] then).

        If the engine stops, each open choice gets a final output with finish_reason "abort"
        and the reason in stop_reason.
        """
        await self._wait(timeout)
        items = list(self._items)
        self._items.clear()
        return items

    async def get(self) -> RequestOutput:
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

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not (self.finished and not self._items):
            for output in await self.get_batch():
                yield output

    def abort(self) -> None:
        """Cancel the request (client gone, stream closed); idempotent, safe after it finished."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self._engine._abort(self.request_id)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        # ("add", (request_id, prompt_ids, params, n)) or ("abort", request_id), oldest first
        self._inbox: deque[tuple[str, object]] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[int, RequestStream] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._next_id = 0
        self.submitted = 0  # requests submitted so far (the inference probe checks it ran alone)
        # the engine thread's pulse: when its loop last went round, and a hook it calls each
        # time (the systemd watchdog); a step that hangs stops both
        self.last_beat = time.monotonic()
        self.heartbeat: Callable[[], None] | None = None
        self.throughput = Throughput()  # sampled with every snapshot; rates read at any time
        self._step_seconds = Histogram()  # written by the engine thread, copied into snapshots
        self._batch_tokens = Histogram(TOKEN_BUCKETS)
        self.stats = self._snapshot(0.0, 0)

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.engine.admission.open()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort everything still running and join the engine thread."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def open_requests(self) -> int:
        """Submitted requests whose outputs are still being read (event-loop side)."""
        return len(self._streams)

    # ------------------------------------------------------------------- event-loop side

    def admit(self, priority_class: PriorityClass, prompts: Sequence[Sequence[int]], timeouts: Timeouts) -> None:
        """Count one HTTP request's prompts into its class's bounded queue, all or none; raises
        AdmissionError (429 / 503 with a Retry-After) when the queue, the load shedder or a
        predicted TTFT past the deadline says no."""
        ttft = priority_class.timeouts.tightened(timeouts).ttft
        self.engine.admission.admit(
            priority_class.name, len(prompts), sum(len(p) for p in prompts),
            shed_level=self.engine.scheduler.shedder.level, ttft_deadline=ttft,
            recover_seconds=self.engine.policy.shedding.recover_seconds,
        )

    def release(self, priority_class: PriorityClass, prompts: Sequence[Sequence[int]]) -> None:
        """Undo `admit` for prompts that were never submitted."""
        self.engine.admission.leave(priority_class.name, len(prompts), sum(len(p) for p in prompts))

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n: int = 1,
        *,
        priority_class: PriorityClass | None = None,
        timeouts: Timeouts | None = None,
        admitted: bool = False,
    ) -> RequestStream:
        """Queue a request; raises RequestError (never runnable) or EngineDeadError at once.
        `admitted`: `admit` counted it, and the engine releases it from the queue bound."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        self.engine.check_request(prompt_ids, params, n, priority_class)
        # ids are handed out here, on the loop, so the stream exists before any output does
        request_id = self._next_id
        self._next_id += 1
        stream = RequestStream(self, request_id, n)
        self._streams[request_id] = stream
        self.submitted += 1
        options = {"priority": priority_class, "timeouts": timeouts, "arrival_time": time.monotonic(),
                   "admitted": admitted}
        self._inbox.append(("add", (request_id, list(prompt_ids), params, n, options)))
        self._wakeup.set()
        return stream

    def _abort(self, request_id: int) -> None:
        self._streams.pop(request_id, None)  # nobody reads its outputs any more
        self._inbox.append(("abort", request_id))
        self._wakeup.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if stream.finished:
                del self._streams[stream.request_id]

    def _fail(self, message: str, request_ids: list[int] | None = None) -> None:
        """End streams (all of them by default) with an abort carrying `message`."""
        for request_id in list(self._streams) if request_ids is None else request_ids:
            stream = self._streams.pop(request_id, None)
            for index in sorted(stream.open_choices) if stream else ():
                stream._put(RequestOutput(request_id, [], "", index=index, finished=True,
                                          finish_reason="abort", stop_reason=message))

    # ---------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        engine = self.engine
        steps, published = self.stats.steps, 0.0
        try:
            while not self._stopping:
                while self._inbox:
                    kind, payload = self._inbox.popleft()
                    if kind == "add":
                        request_id, prompt_ids, params, n, options = payload  # type: ignore[misc]
                        try:
                            engine.add_request(prompt_ids, params, n=n, request_id=request_id, **options)
                        except ValueError as e:  # checked on the loop already; never kill the loop
                            self._unadmit(payload)
                            self._loop.call_soon_threadsafe(self._fail, str(e), [request_id])  # type: ignore[union-attr]
                    else:
                        engine.abort(payload)  # type: ignore[arg-type]
                self.last_beat = time.monotonic()
                if self.heartbeat is not None:
                    self.heartbeat()
                if not engine.has_work():
                    self.stats = self._snapshot(0.0, steps)  # e.g. blocks an abort freed
                    self._wakeup.wait(HEARTBEAT_SECONDS)  # (bounded: an idle loop still beats)
                    self._wakeup.clear()
                    continue
                start = time.perf_counter()
                outputs = engine.step()
                end = time.perf_counter()
                steps += 1
                if engine.last_step_tokens:
                    self._step_seconds.observe(end - start)
                    self._batch_tokens.observe(engine.last_step_tokens)
                if end - published >= STATS_INTERVAL_SECONDS:  # O(requests): not every step
                    self.stats = self._snapshot(end - start, steps)
                    published = end
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)  # type: ignore[union-attr]
                if not engine.last_step_tokens:
                    # work is waiting but none can run now (e.g. load shedding holds it back):
                    # look again soon, for timeouts and freed room, without spinning
                    self._wakeup.wait(IDLE_POLL_SECONDS)
                    self._wakeup.clear()
        except BaseException as e:  # noqa: BLE001 - a dead engine must fail its streams, not hang them
            log.exception("the engine loop failed")
            self._stopping = True
            self._drop_inbox()
            self._loop.call_soon_threadsafe(self._fail, f"engine failure: {e}")  # type: ignore[union-attr]
            return
        self._drop_inbox()
        for request_id in list(engine.request_ids()):
            engine.abort(request_id)
        self.stats = self._snapshot(0.0, steps)
        self._loop.call_soon_threadsafe(self._fail, "the server is shutting down")  # type: ignore[union-attr]

    def _drop_inbox(self) -> None:
        """Requests submitted but never added leave the door's queue (their streams are failed)."""
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                self._unadmit(payload)

    def _unadmit(self, payload: object) -> None:
        """A submitted request that never reached the scheduler leaves the queue it was counted in."""
        _request_id, prompt_ids, _params, _n, options = payload  # type: ignore[misc]
        if options["admitted"]:
            cls = self.engine.resolve_class(options["priority"])
            self.engine.admission.leave(cls.name, 1, len(prompt_ids))

    def _snapshot(self, step_seconds: float, steps: int) -> EngineStats:
        engine = self.engine
        bm = engine.block_manager
        scheduler = engine.scheduler
        rejections: Counter[str] = Counter()
        for (_cls, reason), count in list(engine.admission.rejections.items()):
            rejections[reason] += count
        classes = tuple(scheduler.snapshot())
        self.throughput.sample(time.monotonic(), sum(c.generation_tokens for c in classes),
                               sum(c.prompt_tokens for c in classes))
        return EngineStats(
            kv_blocks_total=bm.pool.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            steps=steps,
            preemptions=dict(scheduler.preemptions),
            timeouts=dict(scheduler.timeouts),
            rejections=dict(rejections),
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
            shed_level=scheduler.shedder.level,
            shed_actions=dict(scheduler.shedder.actions),
            last_step_seconds=step_seconds,
            classes=classes,
            requests=tuple(scheduler.requests_snapshot(STATUS_REQUESTS)),
            step_seconds=self._step_seconds.copy(),
            batch_tokens=self._batch_tokens.copy(),
        )
