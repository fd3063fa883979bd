"""The scheduling policy under overload: two priority classes against one class, at F x capacity.

    python bench/overload.py [--factors 2 5] [--duration 40] [--capacity-seconds 20] [--json FILE]
    python bench/overload.py --capacity 1.5      # skip the capacity run: arrivals fully reproducible
    python bench/overload.py --quick             # smoke run: capacity 5 s, arrivals 8 s, factor 2

Every scenario gets a fresh `inferd serve --port 0 --config CONFIG` (the embedded SmolLM2-135M)
with the inferd.toml that `server_config` writes:

    classes  [classes.interactive] (priority 0, TTFT 1 s, TPOT 0.5 s) and [classes.batch]
             (priority 1, TTFT 30 s, TPOT 2 s, sheddable); each request names its class
    single   one [classes.default] with the two classes' queue bounds summed; no class named

Requests are streaming /v1/completions (greedy, EOS ignored): 20% interactive (~32-token prompt,
16 tokens), 80% batch (~128-token prompt, 64 tokens); prompts are windows of one English text.

1. capacity: max_num_seqs (8) streams in a closed loop for --capacity-seconds against a "single"
   server; by Little's law C = 8 / mean latency of the completed requests (no ramp or drain bias).
2. for each factor F: Poisson arrivals at F x C for --duration s (one seeded schedule for both
   scenarios), a fresh connection per request, then a wait (--cap s at most) for every stream.

Outcomes: completed (finish_reason stop/length, then [DONE]), rejected (HTTP 429/503 with
Retry-After), timed_out (finish_reason "timeout", or an SSE error whose code ends in "_timeout"),
lost (anything else: must be 0). Per scenario x factor x class: counts, goodput (completed within
the class's TTFT and TPOT targets, per second of arrivals), p50/p95/p99 TTFT of completed
requests, median TPOT ((last token - first token) / (tokens - 1)), and the CPU seconds of the
server, of this client and of every other process (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from inferd.api.startup import StartupLine

MAX_NUM_SEQS = 8
# prompts are token windows of this text (original prose, ~220 tokens)
TEXT = (
    "The harbour town woke slowly in winter. Before dawn the bakers lit their ovens, and the smell of bread drifted "
    "down the narrow streets toward the water, where fishermen were already checking their nets by lantern light. "
    "Most of the boats had been built by the same family over three generations, and each one carried a small carved "
    "bird on its bow, a custom nobody could fully explain. The old harbour master said the birds were there to find "
    "the way home in fog, which came often in that season and could swallow the lighthouse beam within minutes. By "
    "eight o'clock the market square filled with stalls selling apples, wool, copper pots and second-hand books, and "
    "children ran between them on their way to the school on the hill. The teacher there had arrived from the capital"
    " twenty years earlier, meaning to stay a single year, and had never left. She taught arithmetic with the tide "
    "tables and geography with the names of ports painted on the crates in the warehouse. At dusk the boats came back"
    " one by one, their engines coughing in the cold air, and families gathered on the quay to count them in."
)


@dataclass(frozen=True)
class ClassSpec:
    name: str
    share: float  # of the requests sent
    prompt_tokens: int
    max_tokens: int
    table: dict[str, Any]  # its [classes.NAME] table in the "classes" scenario (targets in seconds)


CLASSES = (
    ClassSpec("interactive", 0.2, 32, 16, {
        "priority": 0, "ttft_target": 1.0, "tpot_target": 0.5, "queue_timeout": 30, "token_timeout": 0,
        "total_timeout": 0, "ttft_timeout": 0, "max_waiting": 64, "max_queued_tokens": 65536}),
    ClassSpec("batch", 0.8, 128, 64, {
        "priority": 1, "ttft_target": 30.0, "tpot_target": 2.0, "max_waiting": 64, "kv_reserve": 0.1,
        "sheddable": True}),
)


def server_config(scenario: str) -> str:
    """The inferd.toml of a scenario ("classes" or "single")."""
    scheduler = {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": 512}
    interactive, batch = (c.table for c in CLASSES)
    if scenario == "classes":
        tables = {"scheduler": {**scheduler, "default_class": "interactive"},
                  **{f"classes.{c.name}": c.table for c in CLASSES}}
    else:  # NOTE: one FIFO class: interactive's targets and timeouts, both classes' queue bounds
        # summed (batch names no max_queued_tokens: the server's default, 65536, is counted)
        tables = {"scheduler": {**scheduler, "default_class": "default"}, "classes.default": {
            **interactive, "max_waiting": interactive["max_waiting"] + batch["max_waiting"],
            "max_queued_tokens": interactive["max_queued_tokens"] + batch.get("max_queued_tokens", 65536)}}
    return "".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
                   for name, table in tables.items())


# ------------------------------------------------------------------------------ the server

@contextlib.contextmanager
def inferd_serve(tmp: Path, name: str, config: str) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """`inferd serve` with `config` in a subprocess, its log in `tmp`: (process, model name, URL)."""
    (tmp / f"{name}.toml").write_text(config)
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--port", "0", "--config", f"{name}.toml"]
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, cwd=tmp)
    try:
        deadline = time.monotonic() + 180
        while not (line := StartupLine.parse(log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"inferd serve did not start (exit code {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield proc, line.name, line.url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process, all its threads (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pid: int) -> tuple[float, float, float, float]:
    """(wall s, busy CPU seconds of the whole machine, of the server, of this process)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), busy, cpu_seconds(pid), cpu_seconds("self")


def cpu_usage(before: tuple[float, ...], after: tuple[float, ...]) -> dict[str, float]:
    wall, busy, server, client = (a - b for a, b in zip(after, before))
    return {"wall_s": wall, "server_cpu_s": server, "client_cpu_s": client,
            "other_cpu_s": max(0.0, busy - server - client), "cores": os.cpu_count() or 1}


# ------------------------------------------------------------------------------ the client

@dataclass
class Record:
    cls: str
    send: float  # seconds since the phase started
    prompt: int  # index into the class's prompt texts
    status: int = 0  # HTTP status; 0: no response
    token_times: list[float] = field(default_factory=list)  # seconds after send, one per token event
    finish_reason: str | None = None
    error: Any = None  # the JSON error object, or a description of what went wrong
    retry_after: str | None = None
    done: bool = False  # `data: [DONE]` arrived
    completion_tokens: int | None = None  # from the usage event
    outcome: str = ""

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def prompt_texts() -> dict[str, list[str]]:
    """Per class, every window of TEXT of its prompt length, decoded: ~N tokens of real English."""
    from inferd.model.loading.loader import default_model_path
    from inferd.text.tokenizer_loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return {c.name: [tokenizer.decode(ids[i:i + c.prompt_tokens]).strip() for i in range(len(ids) - c.prompt_tokens)]
            for c in CLASSES}


def draw(rng: random.Random, prompts: dict[str, list[str]]) -> tuple[ClassSpec, int]:
    """A class (by share) and one of its prompts."""
    spec = CLASSES[0] if rng.random() < CLASSES[0].share else CLASSES[1]
    return spec, rng.randrange(len(prompts[spec.name]))


def classify(r: Record) -> str:
    code = r.error.get("code") if isinstance(r.error, dict) else None
    if r.status in (429, 503):
        return "rejected" if r.retry_after else "lost"
    if r.status == 200 and (r.finish_reason == "timeout" or str(code).endswith("_timeout")):
        return "timed_out"
    if r.status == 200 and r.done and r.error is None and r.finish_reason in ("stop", "length"):
        return "completed"
    return "lost"


def lost_reason(r: Record) -> str:
    if r.status in (429, 503):
        return f"HTTP {r.status} without Retry-After"
    if isinstance(r.error, dict):
        return f"HTTP {r.status}, error code={r.error.get('code')} type={r.error.get('type')}"
    return f"HTTP {r.status}, [DONE]={r.done}, finish_reason={r.finish_reason}, {str(r.error)[:80]}"


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, prompts: dict[str, list[str]],
                 priority: bool) -> None:
        self.session, self.url, self.model, self.prompts, self.priority = session, url, model, prompts, priority
        self.limit = asyncio.Semaphore(4096)  # NOTE: far above any open-loop backlog here: never the limit

    async def send(self, rec: Record, spec: ClassSpec, max_tokens: int = 0) -> None:
        body: dict[str, Any] = {
            "model": self.model, "prompt": self.prompts[spec.name][rec.prompt], "temperature": 0, "ignore_eos": True,
            "max_tokens": max_tokens or spec.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        if self.priority:
            body["priority"] = spec.name
        async with self.limit:
            start = time.perf_counter()
            try:
                async with self.session.post(f"{self.url}/v1/completions", json=body) as resp:
                    rec.status, rec.retry_after = resp.status, resp.headers.get("Retry-After")
                    if resp.status != 200:
                        text = await resp.text()
                        try:
                            rec.error = json.loads(text).get("error", text)
                        except (ValueError, AttributeError):
                            rec.error = text[:200]
                        return
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue  # id:, blank lines, ": keep-alive"
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            rec.done = True
                            continue
                        event = json.loads(data)
                        if "error" in event:
                            rec.error = event["error"]
                        if event.get("usage"):
                            rec.completion_tokens = event["usage"]["completion_tokens"]
                        for choice in event.get("choices") or ():
                            rec.token_times.append(time.perf_counter() - start)  # one event per token
                            rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                rec.error = f"{type(e).__name__}: {e}"
            except asyncio.CancelledError:
                rec.error = "cancelled: still running at the client's cap"
                raise

    async def closed_loop(self, seconds: float, seed: int) -> list[Record]:
        """MAX_NUM_SEQS streams back to back until `seconds`; the last ones are let finish."""
        rng, records, t0 = random.Random(seed), [], time.perf_counter()

        async def worker() -> None:
            while (now := time.perf_counter() - t0) < seconds:
                spec, prompt = draw(rng, self.prompts)
                records.append(rec := Record(spec.name, now, prompt))
                await self.send(rec, spec)

        await asyncio.gather(*(worker() for _ in range(MAX_NUM_SEQS)))
        return records

    async def open_loop(self, schedule: Schedule, cap: float) -> list[Record]:
        """Send each request at its time; then wait up to `cap` s for the last streams to end."""
        tasks, records, t0 = [], [], time.perf_counter()
        for at, spec, prompt in schedule:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            records.append(rec := Record(spec.name, time.perf_counter() - t0, prompt))
            tasks.append(asyncio.create_task(self.send(rec, spec)))
        _, pending = await asyncio.wait(tasks, timeout=cap) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return records


Schedule = list[tuple[float, ClassSpec, int]]  # (send time s, class, prompt index)


def poisson_schedule(rate: float, seconds: float, seed: int, prompts: dict[str, list[str]]) -> Schedule:
    rng, t, schedule = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < seconds:
        schedule.append((t, *draw(rng, prompts)))
    return schedule


# ------------------------------------------------------------------------------ the report

def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else None


def summarize(records: list[Record], spec: ClassSpec, seconds: float) -> dict[str, Any]:
    mine = [r for r in records if r.cls == spec.name]
    counts = Counter(r.outcome for r in mine)
    done = [r for r in mine if r.outcome == "completed" and r.token_times]
    ttfts, tpots = [r.token_times[0] for r in done], [r.tpot for r in done if r.tpot is not None]
    good = [r for r in done if r.token_times[0] <= spec.table["ttft_target"]
            and (r.tpot or 0.0) <= spec.table["tpot_target"]]
    return {
        "class": spec.name, "sent": len(mine), **{k: counts[k] for k in ("completed", "rejected", "timed_out", "lost")},
        "goodput": len(good) / seconds, "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95),
        "ttft_p99": percentile(ttfts, 0.99), "tpot_p50": statistics.median(tpots) if tpots else None,
        "lost_reasons": dict(Counter(lost_reason(r) for r in mine if r.outcome == "lost")),
    }


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(runs: list[dict[str, Any]], capacity: float) -> None:
    head = ("scenario", "F", "class", "sent", "done", "rej", "t/o", "lost", "good/s", "TTFT p50", "p95", "p99", "TPOT p50")
    rows = [head] + [(run["scenario"], f"{run['factor']:g}", s["class"],
                      *(str(s[k]) for k in ("sent", "completed", "rejected", "timed_out", "lost")),
                      *(fmt(s[k]) for k in ("goodput", "ttft_p50", "ttft_p95", "ttft_p99")), fmt(s["tpot_p50"], 3))
                     for run in runs for s in run["summary"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print(f"\ncapacity {capacity:.2f} requests/s; times in s; good/s: completed within TTFT and TPOT targets, "
          "per s of arrivals")
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for run in runs:
        c = run["cpu"]
        print(f"CPU {run['scenario']} x{run['factor']:g} over {c['wall_s']:.0f} s: server {c['server_cpu_s']:.1f} s, "
              f"client {c['client_cpu_s']:.1f} s, other processes {c['other_cpu_s']:.1f} s "
              f"({c['other_cpu_s'] / c['wall_s']:.2f} of {c['cores']} cores)")
    for factor in sorted({run["factor"] for run in runs}):
        p95 = {run["scenario"]: run["summary"][0]["ttft_p95"] for run in runs if run["factor"] == factor}
        single, classes = p95.get("single"), p95.get("classes")
        ratio = f"{single / classes:.2f}x" if single and classes else "n/a"
        print(f"headline x{factor:g}: interactive p95 TTFT, single / classes = {fmt(single)} / {fmt(classes)} = {ratio}")
    lost = [(run, s, reason, n) for run in runs for s in run["summary"] for reason, n in s["lost_reasons"].items()]
    if lost:
        print(f"\n!!!!! {sum(n for *_, n in lost)} LOST REQUESTS (expected 0) !!!!!")
    for run, s, reason, n in lost:
        print(f"!!!!! {run['scenario']} x{run['factor']:g} {s['class']}: {n} x {reason}")


# ------------------------------------------------------------------------------ main

def run_phase(args: argparse.Namespace, tmp: Path, prompts: dict[str, list[str]], scenario: str,
              phase: Callable[[Client], Awaitable[list[Record]]]) -> tuple[list[Record], dict[str, float]]:
    """A fresh server for `scenario`, a warm-up, then `phase(client)` measured; outcomes set."""
    with inferd_serve(tmp, scenario, server_config(scenario)) as (proc, model, url):
        async def go() -> tuple[list[Record], dict[str, float]]:
            connector = aiohttp.TCPConnector(force_close=True, limit=0)  # a fresh connection per request
            # keep-alive comments come every 10 s while a request waits: 120 s of silence is a fault
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                client = Client(session, url, model, prompts, priority=scenario == "classes")
                # warm-up: a few tokens of each class, so no measured request pays first-step costs
                warm = [Record(c.name, 0.0, 0) for c in CLASSES]
                with contextlib.suppress(TimeoutError):  # NOTE: keep-alives defeat sock_read on a stuck server
                    await asyncio.wait_for(asyncio.gather(*(client.send(r, c, 4) for r, c in zip(warm, CLASSES))), 120)
                if not all(r.done for r in warm):
                    sys.exit(f"{scenario} server: the warm-up failed: {[asdict(r) for r in warm]}")
                before = cpu_snapshot(proc.pid)
                records = await phase(client)
                return records, cpu_usage(before, cpu_snapshot(proc.pid))

        records, cpu = asyncio.run(go())
    for r in records:
        r.outcome = classify(r)
    return records, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factors", type=float, nargs="+", help="load in multiples of capacity (default: 2 5)")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per scenario")
    parser.add_argument("--capacity-seconds", type=float, default=20.0, help="length of the closed-loop run")
    parser.add_argument("--capacity", type=float, default=0.0, help="requests/s; skips the capacity run")
    parser.add_argument("--cap", type=float, default=300.0, help="seconds to wait for streams after the arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every record and the summary here")
    parser.add_argument("--quick", action="store_true", help="smoke run: capacity 5 s, arrivals 8 s, factor 2")
    args = parser.parse_args()
    if args.quick:
        args.capacity_seconds, args.duration, args.factors = 5.0, 8.0, args.factors or [2.0]
    args.factors = args.factors or [2.0, 5.0]
    prompts, started = prompt_texts(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="inferd-overload-") as tmp:
        capacity, capacity_records = args.capacity, []
        if not capacity:
            capacity_records, cpu = run_phase(args, Path(tmp), prompts, "single",
                                              lambda c: c.closed_loop(args.capacity_seconds, args.seed))
            latencies = [r.token_times[-1] for r in capacity_records if r.outcome == "completed"]
            if not latencies:
                sys.exit(f"capacity run: none of {len(capacity_records)} requests completed")
            capacity = MAX_NUM_SEQS / statistics.mean(latencies)  # Little's law, closed loop
            print(f"capacity: {capacity:.2f} requests/s ({len(latencies)}/{len(capacity_records)} completed, mean "
                  f"latency {statistics.mean(latencies):.2f} s; other processes {cpu['other_cpu_s']:.1f} CPU s)",
                  flush=True)
        runs = []
        for i, factor in enumerate(args.factors):
            schedule = poisson_schedule(factor * capacity, args.duration, args.seed + 1 + i, prompts)
            for scenario in ("classes", "single"):
                records, cpu = run_phase(args, Path(tmp), prompts, scenario, lambda c: c.open_loop(schedule, args.cap))
                summary = [summarize(records, spec, args.duration) for spec in CLASSES]
                runs.append({"scenario": scenario, "factor": factor, "rate": factor * capacity,
                             "duration": args.duration, "cpu": cpu, "summary": summary,
                             "records": [asdict(r) for r in records]})
                print(f"{scenario} x{factor:g}: {len(records)} requests at {factor * capacity:.2f}/s, "
                      + ", ".join(f"{s['class']} {s['completed']}/{s['sent']} completed" for s in summary)
                      + f" ({time.perf_counter() - started:.0f} s so far)", flush=True)
    print_report(runs, capacity)
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "capacity": capacity, "classes": [asdict(c) for c in CLASSES],
            "capacity_records": [asdict(r) for r in capacity_records], "runs": runs}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
