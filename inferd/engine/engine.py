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
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from inferd.engine.llm_engine import LLMEngine, RequestOutput
from inferd.model.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step (read from any thread)."""

    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    waiting: int
    steps: int
    preemptions: int
    last_step_seconds: float


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
        self.stats = self._snapshot(0.0, 0)

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
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

    # ------------------------------------------------------------------- event-loop side

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, n: int = 1) -> RequestStream:
        """Queue a request; raises RequestError (never runnable) or EngineDeadError at once."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        self.engine.check_request(prompt_ids, params, n)
        # ids are handed out here, on the loop, so the stream exists before any output does
        request_id = self._next_id
        self._next_id += 1
        stream = RequestStream(self, request_id, n)
        self._streams[request_id] = stream
        self._inbox.append(("add", (request_id, list(prompt_ids), params, n)))
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
        try:
            while not self._stopping:
                while self._inbox:
                    kind, payload = self._inbox.popleft()
                    if kind == "add":
                        request_id, prompt_ids, params, n = payload  # type: ignore[misc]
                        try:
                            engine.add_request(prompt_ids, params, n=n, request_id=request_id)
                        except ValueError as e:  # checked on the loop already; never kill the loop
                            self._loop.call_soon_threadsafe(self._fail, str(e), [request_id])  # type: ignore[union-attr]
                    else:
                        engine.abort(payload)  # type: ignore[arg-type]
                if not engine.has_work():
                    self.stats = self._snapshot(0.0, self.stats.steps)  # e.g. blocks an abort freed
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                start = time.perf_counter()
                outputs = engine.step()
                self.stats = self._snapshot(time.perf_counter() - start, self.stats.steps + 1)
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)  # type: ignore[union-attr]
        except BaseException as e:  # noqa: BLE001 - a dead engine must fail its streams, not hang them
            log.exception("the engine loop failed")
            self._stopping = True
            self._loop.call_soon_threadsafe(self._fail, f"engine failure: {e}")  # type: ignore[union-attr]
            return
        for request_id in list(engine.request_ids()):
            engine.abort(request_id)
        self.stats = self._snapshot(0.0, self.stats.steps)
        self._loop.call_soon_threadsafe(self._fail, "the server is shutting down")  # type: ignore[union-attr]

    def _snapshot(self, step_seconds: float, steps: int) -> EngineStats:
        engine = self.engine
        bm = engine.block_manager
        return EngineStats(
            kv_blocks_total=bm.pool.num_blocks,
            kv_blocks_used=bm.pool.num_blocks - bm.num_free_blocks,
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            steps=steps,
            preemptions=engine.scheduler.num_preemptions,
            last_step_seconds=step_seconds,
        )
