"""`inferd bench URL`: a load generator and report for any OpenAI-compatible server, over HTTP only.

    BenchConfig --run()--> for each sweep point: closed loop (N workers, each one request at a
                           time) or open loop (gamma / Poisson arrivals at R req/s)
                               └─ send_retrying() per request          (bench_retry)
                                   └─ send() per attempt → RequestRecord  (bench_http)
                           summarize(records) per point                (bench_metrics, pure)
                           render / --json / --plot                    (bench_report, pure)

`--workload conversation` runs multi-turn chats instead (bench_conversation): C conversations at
once, each turn waiting for the last one's answer, reported with first-turn and later-turn TTFT.
`--workload agent` runs coding-agent sessions in the same loop (bench_agent: tool schemas, files
and command output, two turns a session that copy a file), reported with copy turns apart, the
prefix cache's share of prompt tokens and speculation's acceptance.

The modules: bench_config (the options, checked once), bench_workload (prompts, lengths, classes, arrivals), bench_http (the streamed
request, /v1/models, inferd's /metrics counters), bench_retry (--retries: what is retried, the
backoff), bench_metrics (records and vLLM's metric definitions), bench_report (tables, compare,
plots).

A failure every request would share (nobody listening, a refused API key) stops the run after
the requests already sent, instead of repeating it for --duration; other failures are counted.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from inferd.client.bench_agent import AgentWorkload, render_agent
from inferd.client.bench_conversation import (
    ConversationWorkload, conversation_loop, summarize_turns,
)
from inferd.client.bench_http import (
    BenchError, counter_deltas, describe, is_fatal, list_models, read_counters, request_body, root_url,
)
from inferd.client.bench_metrics import RequestRecord, parse_slo, summarize
from inferd.client.bench_report import load_result, render_compare, render_run, render_sweep, write_plot
from inferd.client.bench_retry import send_retrying
from inferd.client.bench_workload import RequestSpec, Workload, load_dataset, parse_mix
from inferd.client.bench_workload import arrival_times as _arrival_times

from inferd.client.bench_config import (DEFAULT_NUM_REQUESTS, ENDPOINTS, JSON_VERSION, BenchConfig, Point,
                                        parse_list)

__all__ = ["BenchConfig", "BenchError", "Point", "compare", "parse_list", "run"]


# ---------------------------------------------------------------------------------- running


@dataclass
class _Context:
    config: BenchConfig
    session: aiohttp.ClientSession
    root: str
    model: str
    workload: Workload
    progress: Progress | None
    conversations: ConversationWorkload | AgentWorkload | None = None  # --workload conversation or agent
    t0: float = 0.0  # the current run's start (perf_counter)

    async def request(self, i: int, stream: str) -> RequestRecord:
        return await self.send(i, self.workload.spec(i, stream), stream)

    async def send(self, i: int, spec: RequestSpec, stream: str) -> RequestRecord:
        config = self.config
        record = RequestRecord(index=i, priority=spec.priority)
        body = request_body(spec, self.model, chat=config.endpoint == "chat", ignore_eos=config.ignore_eos)
        rng = random.Random(f"inferd-bench-retry:{config.seed}:{stream}:{i}")  # this request's jitter
        return await send_retrying(self.session, self.root + ENDPOINTS[config.endpoint], body, record,
                                   api_key=config.api_key, t0=self.t0, policy=config.retry, rng=rng)


async def _closed_loop(
    n_workers: int, one: Callable[[int], Awaitable[bool]], num: int | None, deadline: float | None,
) -> None:
    """`n_workers` workers, each sending its next request when its last one ended; `one(i)`
    returns False to stop every worker."""
    counter = itertools.count()
    stop = False

    async def worker() -> None:
        nonlocal stop
        while not stop:
            i = next(counter)
            if (num is not None and i >= num) or (deadline is not None and time.perf_counter() >= deadline):
                return
            if not await one(i):
                stop = True

    await asyncio.gather(*(worker() for _ in range(n_workers)))


async def _open_loop(
    times: list[float], one: Callable[[int], Awaitable[bool]], cap: int | None, t0: float,
) -> None:
    """Request i sent at t0 + times[i] (or when one of `cap` slots frees up after that)."""
    stop = asyncio.Event()
    slots = asyncio.Semaphore(cap) if cap else None

    async def task(i: int) -> None:
        if slots is None:
            ok = await one(i)
        else:
            async with slots:
                if stop.is_set():
                    return
                ok = await one(i)
        if not ok:
            stop.set()

    tasks = []
    for i, t in enumerate(times):
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
        if stop.is_set():
            break
        tasks.append(asyncio.ensure_future(task(i)))
    await asyncio.gather(*tasks)


async def _run_point(ctx: _Context, point: Point, stream: str) -> tuple[list[RequestRecord], float]:
    config = ctx.config
    records: list[RequestRecord] = []
    num = config.num_requests if config.duration is None else None
    task = None
    if ctx.progress is not None:
        task = ctx.progress.add_task(point.label, total=num if num is not None else config.duration)

    failed = 0

    def keep(record: RequestRecord) -> bool:
        nonlocal failed
        records.append(record)
        failed += not record.ok
        if ctx.progress is not None and task is not None:
            done = len(records) if num is not None else min(time.perf_counter() - ctx.t0, config.duration or 0)
            ctx.progress.update(task, completed=done,
                                description=f"{point.label}  {len(records)} done" + (f", {failed} failed" if failed else ""))
        return not (is_fatal(record) and failed == len(records))  # nobody there: stop sending

    async def one(i: int) -> bool:
        return keep(await ctx.request(i, stream))

    async def turn(i: int, spec: RequestSpec, number: int, conversation: int) -> tuple[RequestRecord, bool]:
        record = await ctx.send(i, spec, stream)
        record.turn, record.conversation = number, conversation
        return record, keep(record)

    ctx.t0 = time.perf_counter()
    deadline = ctx.t0 + config.duration if config.duration is not None else None
    if ctx.conversations is not None:
        await conversation_loop(point.concurrency or 1, ctx.conversations, stream, turn, num, deadline)
    elif point.rate is None:
        await _closed_loop(point.concurrency or 1, one, num, deadline)
    else:
        times = _arrival_times(point.rate, config.burstiness, seed=config.seed, n=num, duration=config.duration)
        await _open_loop(times, one, point.concurrency, ctx.t0)
    duration = time.perf_counter() - ctx.t0
    if ctx.progress is not None and task is not None:
        ctx.progress.remove_task(task)
    return sorted(records, key=lambda r: r.index), duration


async def _warmup(ctx: _Context, point: Point) -> None:
    """--warmup requests, sent first and not recorded (whole conversations, as far as they go)."""
    n, progress, ctx.progress = ctx.config.warmup, ctx.progress, None
    if ctx.conversations is None:
        await _closed_loop(min(n, point.concurrency or n), lambda i: _ok(ctx.request(i, "warmup")), n, None)
    else:

        async def turn(i: int, spec: RequestSpec, number: int, conversation: int) -> tuple[RequestRecord, bool]:
            record = await ctx.send(i, spec, "warmup")
            return record, not is_fatal(record)

        await conversation_loop(min(n, point.concurrency or 1), ctx.conversations, "warmup", turn, n, None)
    ctx.progress = progress


async def _bench(
    config: BenchConfig, workload: Workload, out: Console, err: Console,
    conversations: ConversationWorkload | AgentWorkload | None,
) -> dict[str, Any]:
    root = root_url(config.url)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=config.timeout)
    # NOTE: a fresh connection per request: llama-server failed requests sent on a kept-alive
    # connection after a stream ("Can not write request body", FACTS.md)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model
        if model is None:
            try:
                model = (await list_models(session, root, config.api_key))[0]
            except BenchError as e:
                if not e.fatal:
                    raise
                model = "-"  # every request fails the same way: they count it and say why
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=err, transient=True)
        ctx = _Context(config, session, root, model, workload, progress, conversations)
        result: dict[str, Any] = {
            "tool": "inferd bench", "version": JSON_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": config.to_json(), "server": {"url": root, "model": model, "inferd": None}, "runs": [],
        }
        slo = parse_slo(config.slo)
        with progress:
            points = config.points()
            if config.warmup:
                await _warmup(ctx, points[0])
            for k, point in enumerate(points):
                before = await read_counters(session, root, config.api_key)
                result["server"]["inferd"] = before is not None
                records, duration = await _run_point(ctx, point, f"point{k}")
                after = await read_counters(session, root, config.api_key)
                summary = summarize(records, slo, duration) | _session_summary(config, conversations, records)
                run = {
                    "label": point.label, "concurrency": point.concurrency, "rate": point.rate,
                    "burstiness": config.burstiness if point.rate is not None else None,
                    "summary": summary,
                    "server_counters": counter_deltas(before, after),
                    "requests": [r.to_json() for r in records],
                }
                result["runs"].append(run)
                progress.stop()
                out.print(render_run(run, f"{point.label}  ({_kind(config, conversations)}, {model} at {root})"))
                if isinstance(conversations, AgentWorkload):
                    out.print(render_agent(summary))
                progress.start()
                fatal = next((r for r in records if is_fatal(r)), None)
                if fatal is not None and not any(r.ok for r in records):
                    result["fatal"] = describe(fatal, root + ENDPOINTS[config.endpoint], config.api_key)
                    break
    if len(result["runs"]) > 1:
        out.print(render_sweep(result))
    return result


def _session_summary(config: BenchConfig, conversations: ConversationWorkload | AgentWorkload | None,
                     records: list[RequestRecord]) -> dict[str, Any]:
    """The conversation or agent workload's own figures (none for the requests workload)."""
    if isinstance(conversations, AgentWorkload):
        return conversations.summarize(records)
    return {} if conversations is None else summarize_turns(records, config.turns)


def _kind(config: BenchConfig, conversations: ConversationWorkload | AgentWorkload | None) -> str:
    if isinstance(conversations, AgentWorkload):
        return f"agent sessions of {conversations.turns} turns, chat"
    return config.endpoint if conversations is None else f"conversations of {config.turns} turns, chat"


async def _ok(request: Awaitable[RequestRecord]) -> bool:
    return not is_fatal(await request)


def run(config: BenchConfig, out: Console | None = None, err: Console | None = None) -> dict[str, Any]:
    """Run the benchmark, print its summaries, write --json and --plot; the result dict.

    BenchError with one line when the options are wrong, the server cannot be used, or no
    request succeeded (after the report and the files are written)."""
    out = out or Console()
    err = err or Console(stderr=True)
    try:
        config.check()
        dataset = load_dataset(config.dataset) if config.dataset else None
        workload = Workload(
            seed=config.seed, chat=config.endpoint == "chat", input_len=config.input_len,
            input_dist=config.input_dist, output_len=config.output_len, output_dist=config.output_dist,
            spread=config.spread, priority_mix=parse_mix(config.priority_mix), dataset=dataset,
        )
        shape = config.conversation
        conversations: ConversationWorkload | AgentWorkload | None = None
        if config.workload == "agent":
            conversations = AgentWorkload(seed=config.seed)
        elif shape is not None:
            conversations = ConversationWorkload(shape, config.seed)
        if conversations is not None:
            config = replace(config, endpoint="chat")  # a conversation is a chat
        parse_slo(config.slo)
        config.points()
        if config.num_requests is None and config.duration is None:
            config = BenchConfig(**{**asdict(config), "num_requests": DEFAULT_NUM_REQUESTS})
    except ValueError as e:
        raise BenchError(str(e)) from None
    result = asyncio.run(_bench(config, workload, out, err, conversations))
    if config.json_path:
        Path(config.json_path).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if config.plot_path:
        try:
            write_plot(result, config.plot_path)
        except ValueError as e:
            raise BenchError(str(e)) from None
    if "fatal" in result:
        raise BenchError(result["fatal"])
    if not any(run["summary"]["completed"] for run in result["runs"]):
        errors = result["runs"][-1]["summary"]["errors"]
        kind, n = next(iter(errors["by_type"].items()))
        raise BenchError(f"no request succeeded: {n} × {kind} ({errors['examples'][kind]})")
    return result


def compare(path_a: str, path_b: str, out: Console | None = None) -> None:
    """Print two `--json` results side by side with B/A ratios; BenchError for a bad file."""
    try:
        a, b = load_result(path_a), load_result(path_b)
    except ValueError as e:
        raise BenchError(str(e)) from None
    (out or Console()).print(render_compare(a, b, (Path(path_a).name, Path(path_b).name)))
