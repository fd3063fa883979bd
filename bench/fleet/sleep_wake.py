"""Sleep and wake, and a load on demand, beside a busy model (issue 46): does model A's stream of
tokens pause while model B sleeps, wakes or loads?

    .venv/bin/python bench/fleet/sleep_wake.py                 # ~1.5 min on the 2-core machine
    .venv/bin/python bench/fleet/sleep_wake.py --requests 0    # the events alone, no B requests

One `inferd serve` subprocess with three models, each the embedded SmolLM2-135M with its own
weights, KV cache and engine thread: `a` and `b` loaded at start, `c` on demand (and unloaded
after 1 s idle, so that each round loads it again). --streams closed-loop streaming requests run
on `a` throughout (greedy, EOS ignored, --max-tokens each); every token event's arrival is timed
here. After --warmup s, --baseline s of `a` alone: the median gap between two tokens of a request
is `a`'s decode step. Then --rounds rounds of three phases, each after --control quiet seconds:

    sleep/wake 1   POST /admin/models/b/sleep {"level": 1}; --requests requests for `b` sent at
                   once (they wait); --asleep s later POST /admin/models/b/wake; until they are answered
    sleep/wake 2   the same at level 2 (the wake loads `b` from the file again)
    load           a request for `c`, which loads it on demand

Each event (sleep 1, wake 1, sleep 2, wake 2, load) is the window from its request to its answer
plus 0.5 s; its figure is the largest pause of `a` (between two tokens of one request) overlapping
that window, each round's, beside the largest pause in the quiet window before it (the control:
what this machine gives with nothing happening). The acceptance (issue 46): a sleep, or a wake
from level 1, pauses `a` no more than one step more than a step (2 x the median step); a load (a
wake from level 2 is one) no more than 2 s.
`b`'s and `c`'s requests: answered (after waiting) or 503 with a Retry-After; anything else is
lost. On 2 cores a load's work (and `b` answering its requests) competes with `a`'s for the cores.
Exit status 1 when a request is lost or one of `a`'s fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overload import cpu_snapshot, cpu_usage, inferd_serve  # noqa: E402  (bench/'s)

CONFIG = """[server]
probe_interval_seconds = 0
model_load_wait_seconds = 60

[shedding]
enabled = false

[models.a]
kv_cache_memory = "{kv}"

[models.b]
kv_cache_memory = "{kv}"

[models.c]
load = "on_demand"
idle_unload_seconds = 1
kv_cache_memory = "{kv}"
"""
TAIL_SECONDS = 0.5  # after an event's answer, still its doing (a woken model's first steps)
PROMPT = "Write a long story about a lighthouse keeper and the sea. Once upon a time"


@dataclass
class Gaps:
    """(arrival time of the later token, gap seconds) of every two consecutive tokens of a request."""

    gaps: list[tuple[float, float]] = field(default_factory=list)
    failed: int = 0
    answered: int = 0

    def within(self, start: float, end: float) -> list[float]:
        return [g for t, g in self.gaps if start <= t <= end]

    def overlapping(self, start: float, end: float) -> list[float]:
        """The gaps (pauses) that overlap [start, end]."""
        return [g for t, g in self.gaps if t >= start and t - g <= end]

    def worst_at(self, start: float, end: float) -> float:
        """When the largest gap overlapping [start, end] began, in s after `start`."""
        found = max(((g, t) for t, g in self.gaps if t >= start and t - g <= end), default=(0.0, start))
        return found[1] - found[0] - start


async def stream_once(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int, gaps: Gaps) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    last = None
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            gaps.failed += 1
            return
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if json.loads(line[6:]).get("choices"):
                if last is not None:
                    gaps.gaps.append((now, now - last))
                last = now
    gaps.answered += 1


async def closed_loop(url: str, model: str, streams: int, max_tokens: int, stop: asyncio.Event, gaps: Gaps) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(k: int) -> None:
            first = max(8, max_tokens * (k + 1) // streams)  # (staggered ends: no lockstep)
            while not stop.is_set():
                await stream_once(session, url, model, first, gaps)
                first = max_tokens
        await asyncio.gather(*(worker(k) for k in range(streams)))


async def ask(session: aiohttp.ClientSession, url: str, model: str) -> dict[str, Any]:
    """A short request that may wait: its outcome."""
    start = time.perf_counter()
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            await r.read()
            return {"status": r.status, "retry_after": r.headers.get("Retry-After"),
                    "seconds": round(time.perf_counter() - start, 2)}
    except aiohttp.ClientError as e:
        return {"status": None, "error": str(e), "seconds": round(time.perf_counter() - start, 2)}


async def admin(session: aiohttp.ClientSession, url: str, path: str, body: Any = None) -> dict[str, Any]:
    start = time.perf_counter()
    async with session.post(f"{url}{path}", json=body) as r:
        answer = await r.json(content_type=None)
    return {"status": r.status, "client_seconds": round(time.perf_counter() - start, 2), **answer}


Event = tuple[str, float, float]  # (what, when it was sent, when it was answered)


async def sleep_phase(session: aiohttp.ClientSession, url: str, level: int, args: argparse.Namespace
                      ) -> tuple[list[Event], dict[str, Any]]:
    """Sleep b, --requests requests for it meanwhile, wake it --asleep s later; until they are answered."""
    t = time.perf_counter()
    slept = await admin(session, url, "/admin/models/b/sleep", {"level": level})
    events = [(f"sleep {level}", t, time.perf_counter())]
    waiting = [asyncio.ensure_future(ask(session, url, "b")) for _ in range(args.requests)]
    await asyncio.sleep(args.asleep)
    t = time.perf_counter()
    woke = await admin(session, url, "/admin/models/b/wake")
    events.append((f"wake {level}", t, time.perf_counter()))
    outcomes = await asyncio.gather(*waiting)
    return events, {"sleep": slept, "wake": woke, "requests": outcomes}


async def load_phase(session: aiohttp.ClientSession, url: str, args: argparse.Namespace
                     ) -> tuple[list[Event], dict[str, Any]]:
    """A request for c, loaded on demand by it (c unloads itself when idle, for the next round)."""
    while (await status_of(session, url))["c"]["state"] != "unloaded":
        await asyncio.sleep(0.2)
    t = time.perf_counter()
    outcome = await ask(session, url, "c")
    return [("load", t, time.perf_counter())], {"requests": [outcome]}


async def status_of(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/status") as r:
        return {m["name"]: m for m in (await r.json())["models"]}


def lost(requests: list[dict[str, Any]]) -> int:
    """Requests neither answered nor refused with 503 and a Retry-After."""
    return sum(not (r["status"] == 200 or (r["status"] == 503 and r.get("retry_after"))) for r in requests)


def others(cpu: dict[str, float]) -> float:
    """Other processes' share of the cores (the machine may be shared: their load pauses `a` too)."""
    return cpu["other_cpu_s"] / cpu["wall_s"] / cpu["cores"]


async def run(url: str, pid: int, args: argparse.Namespace) -> int:
    gaps, stop = Gaps(), asyncio.Event()
    load = asyncio.ensure_future(closed_loop(url, "a", args.streams, args.max_tokens, stop, gaps))
    await asyncio.sleep(args.warmup)
    t0, cpu0 = time.perf_counter(), cpu_snapshot(pid)
    await asyncio.sleep(args.baseline)
    baseline = gaps.within(t0, time.perf_counter())
    step = statistics.median(baseline)
    print(f"baseline: a's {args.streams} streams, {args.baseline:g} s: {len(baseline)} gaps, median step "
          f"{step * 1000:.1f} ms, p99 {sorted(baseline)[int(0.99 * (len(baseline) - 1))] * 1000:.1f} ms, max "
          f"{max(baseline) * 1000:.1f} ms; other processes' CPU {others(cpu_usage(cpu0, cpu_snapshot(pid))):.0%}")
    worst: dict[str, list[tuple[float, float]]] = {}  # event -> (its max gap, the control window's), per round
    began: dict[str, list[float]] = {}  # event -> when its largest gap began (s after it was sent), per round
    took: dict[str, list[float]] = {}  # event -> its seconds (sent to answered), per round
    lost_requests, outcomes = 0, []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for round_ in range(args.rounds):
            for phase in (sleep_phase(session, url, 1, args), sleep_phase(session, url, 2, args),
                          load_phase(session, url, args)):
                await asyncio.sleep(args.control)  # (a quiet window, the control for the next event)
                events, detail = await phase
                await asyncio.sleep(TAIL_SECONDS)
                for what, sent, answered in events:
                    during = gaps.overlapping(sent, answered + TAIL_SECONDS)
                    control = gaps.overlapping(sent - args.control, sent - 0.05)
                    worst.setdefault(what, []).append((max(during, default=0.0), max(control, default=0.0)))
                    began.setdefault(what, []).append(gaps.worst_at(sent, answered + TAIL_SECONDS))
                    took.setdefault(what, []).append(answered - sent)
                lost_requests += lost(detail["requests"])
                outcomes += [f"{r['status']} after {r['seconds']:.1f} s" for r in detail["requests"]]
                if round_ == 0:
                    print(f"round 1: {json.dumps({k: v for k, v in detail.items() if k != 'requests'})}")
    stop.set()
    await load
    print(f"{'event':8} {'rounds':>6} {'a max gap ms (each round)':>34} {'control ms':>22} {'x step':>7} bound")
    for what, pairs in worst.items():
        bound = 2.0 if what in ("load", "wake 2") else 2 * step  # (a level-2 wake is a load from the file)
        print(f"{what:8} {len(pairs):>6} {' '.join(f'{g * 1000:.0f}' for g, _ in pairs):>34} "
              f"{' '.join(f'{c * 1000:.0f}' for _, c in pairs):>22} {max(g for g, _ in pairs) / step:>7.1f} "
              f"{'ok' if max(g for g, _ in pairs) <= bound else 'OVER'} ({bound * 1000:.0f} ms)")
    for what in worst:
        print(f"{what}: took {', '.join(f'{t:.2f}' for t in took[what])} s; its largest gap began at +"
              f"{', +'.join(f'{t:.2f}' for t in began[what])} s")
    print(f"b and c requests: {len(outcomes)}, lost {lost_requests}: {', '.join(outcomes)}")
    print(f"a: {gaps.answered} requests answered, {gaps.failed} failed")
    return int(bool(lost_requests or gaps.failed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--baseline", type=float, default=6.0)
    parser.add_argument("--asleep", type=float, default=2.0, help="seconds between a sleep and its wake")
    parser.add_argument("--rounds", type=int, default=3, help="each event this many times")
    parser.add_argument("--control", type=float, default=2.0, help="the quiet window before each event (s)")
    parser.add_argument("--requests", type=int, default=3, help="requests for b while it sleeps")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with inferd_serve(Path(tmp), "sleep_wake", CONFIG.format(kv=args.kv_cache_memory)) as (proc, _, url):
            status = asyncio.run(run(url, proc.pid, args))
            log = (Path(tmp) / "sleep_wake.log").read_text()
    print("\n".join(line for line in log.splitlines() if "model b:" in line or "model c:" in line))
    sys.exit(status)


if __name__ == "__main__":
    main()
