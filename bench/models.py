"""Two models in one server (issue 12): each one's throughput alone and together, and the gap in
service while one of them is reloaded.

    .venv/bin/python bench/models.py            # ~4-5 min on the 2-core machine
    .venv/bin/python bench/models.py --quick    # a ~75 s smoke run (its numbers are not for recording)

One `inferd serve --config CONFIG` subprocess for the whole run, with two models `a` and `b`: both
the embedded SmolLM2-135M, each with its own weights, KV cache (--kv-cache-memory) and engine
thread. Shedding is off, and the inference probe runs only at start-up and in the reload (no
periodic runs to disturb the numbers). Requests are streaming /v1/completions, greedy, EOS
ignored, with ~32-token prompts from bench_workload's seeded set (a different draw per phase and
model, so no phase finds another's prompts in the prefix cache). The load is closed-loop: each
stream sends its next request when its last one ends (stream k's first request asks for
(k + 1) / concurrency of the tokens, so the streams do not move in lockstep). After one warm-up
round on each model:

1. throughput: --concurrency streams per model of --max-tokens tokens, for --seconds in each
   phase: a alone, b alone, a and b together (each model at the same concurrency). A model's
   output tok/s = its token events that arrived in the phase's last 90% (every stream busy: no
   ramp, no drain) / the window's length. The two engine threads share the machine's cores: on 2
   cores "together" is expected near "alone" in sum, and near half of it per model.
2. reload gap: --concurrency streams on `a` of --reload-max-tokens tokens (short, so TTFT samples
   are many). After --before s (plus a short settle), POST /admin/models/a/reload
   {"revision": "r2"} while the load goes on; it stops --after s after the reload's answer.
       before:  requests sent in the --before s before the reload began, with their first token
                before it too;
       during:  requests sent from the reload's start to --after s after its answer (split into
                "loading" (until the answer) and "after the swap").
   TTFT p50/p99/max of each, the reload's own duration (POST to its 200), the failed requests
   (must be 0: none lost or cut) and short ones (fewer tokens than asked: must be 0), and the
   x-inferd-model header of every response: a@r1 before the reload, a@r2 after its answer.

TTFT is the client's: from the send to the first token event. The CPU seconds of the server, of
this client and of every other process are printed per phase (the machine may be shared).
Exit status 1 when a request failed or was short, the reload was refused, or a header was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import aiohttp

from inferd.client.bench_http import request_body, send
from inferd.api.startup import StartupLine
from inferd.client.bench_metrics import RequestRecord, percentile, summarize
from inferd.client.bench_workload import Workload
from overload import cpu_snapshot, cpu_usage, inferd_serve  # (bench/ is this script's folder)

MODELS = ("a", "b")
RELOADED = "a"
PROMPT_TOKENS = 32
WINDOW_SKIP = 0.1  # the share of a throughput phase left out at its start (the ramp)
SETTLE_SECONDS = 3.0  # reload phase: load before the "before" window opens


def server_config(args: argparse.Namespace) -> str:
    dtype = f'dtype = "{args.dtype}"\n' if args.dtype else ""
    models = "".join(f'[models.{m}]\nrevision = "r1"\nkv_cache_memory = "{args.kv_cache_memory}"\n{dtype}\n'
                     for m in MODELS)
    return f"[server]\nprobe_interval_seconds = 0\n\n[shedding]\nenabled = false\n\n{models}"


# ------------------------------------------------------------------------------ the load


@dataclass
class Load:
    """Closed-loop streams on one model until `deadline` (perf_counter; it may be moved while the
    load runs). Records are appended as requests end."""

    model: str
    stream: str  # the workload's stream: which seeded prompts
    max_tokens: int
    deadline: float = math.inf
    records: list[RequestRecord] = field(default_factory=list)
    short: int = 0  # requests that completed with fewer tokens than they asked for


async def closed_loop(session: aiohttp.ClientSession, root: str, load: Load, concurrency: int, t0: float) -> None:
    """`concurrency` streams, each sending its next request when its last one ends.

    NOTE: stream k's first request asks for (k + 1) / concurrency of the tokens. Requests of one
    length that all start at once would move in lockstep (prefill together, end together: TTFT
    samples in waves of `concurrency`); this staggers their ends once, and requests of equal
    length keep them staggered.
    """
    workload = Workload(seed=0, input_len=PROMPT_TOKENS, output_len=load.max_tokens)
    counter = itertools.count()

    async def worker(k: int) -> None:
        max_tokens = max(1, round(load.max_tokens * (k + 1) / concurrency))
        while time.perf_counter() < load.deadline:
            i = next(counter)
            body = request_body(workload.spec(i, load.stream), load.model, chat=False, ignore_eos=True)
            body["max_tokens"] = max_tokens
            record = await send(session, f"{root}/v1/completions", body, RequestRecord(index=i), api_key=None, t0=t0)
            load.records.append(record)
            load.short += record.ok and record.output_tokens != max_tokens
            max_tokens = load.max_tokens

    await asyncio.gather(*(worker(k) for k in range(concurrency)))


def client_session(trace: aiohttp.TraceConfig | None = None) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                 trace_configs=[trace] if trace else None)


def token_times(record: RequestRecord) -> Iterator[float]:
    """When each token event arrived, in seconds since the phase's start."""
    if record.ttft is None:
        return
    t = record.send_time + record.ttft
    yield t
    for gap in record.itl:
        t += gap
        yield t


def failures(load: Load) -> dict[str, Any]:
    failed = [r for r in load.records if not r.ok]
    return {"failed": len(failed), "short": load.short,
            "by_type": dict(Counter(str(r.error_type) for r in failed)),
            "example": failed[0].error if failed else None}


# ------------------------------------------------------------------------------ 1. throughput


async def throughput_phase(root: str, models: tuple[str, ...], args: argparse.Namespace, pid: int,
                           name: str) -> dict[str, Any]:
    async with client_session() as session:
        cpu0 = cpu_snapshot(pid)
        t0 = time.perf_counter()
        loads = [Load(m, f"{name}-{m}", args.max_tokens, deadline=t0 + args.seconds) for m in models]
        await asyncio.gather(*(closed_loop(session, root, load, args.concurrency, t0) for load in loads))
        cpu = cpu_usage(cpu0, cpu_snapshot(pid))
    lo, hi = WINDOW_SKIP * args.seconds, args.seconds
    per_model = {}
    for load in loads:
        records = load.records
        tokens = sum(lo <= t < hi for r in records for t in token_times(r))
        s = summarize(records, by_class=False)
        per_model[load.model] = {
            "requests": s["completed"], "tok_s": tokens / (hi - lo), "ttft_p50": s["ttft"]["p50"],
            "tpot_p50": s["tpot"]["p50"], **failures(load),
            "chunks_not_tokens": sum(r.ok and r.chunks != r.output_tokens for r in records),
        }
    return {"phase": name, "models": per_model, "cpu": cpu}


# ------------------------------------------------------------------------------ 2. the reload


async def reload_phase(root: str, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    seen: list[tuple[float, str | None]] = []  # (perf_counter at the send, x-inferd-model) per response

    async def on_start(_: Any, ctx: Any, __: Any) -> None:
        ctx.start = time.perf_counter()

    async def on_end(_: Any, ctx: Any, params: aiohttp.TraceRequestEndParams) -> None:
        seen.append((ctx.start, params.response.headers.get("x-inferd-model")))

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    trace.on_request_end.append(on_end)
    async with client_session(trace) as session:
        cpu0 = cpu_snapshot(pid)
        t0 = time.perf_counter()
        load = Load(RELOADED, "reload", args.reload_max_tokens)
        running = asyncio.create_task(closed_loop(session, root, load, args.concurrency, t0))
        await asyncio.sleep(args.settle + args.before)
        start = time.perf_counter()
        answer: Any
        try:
            async with client_session() as admin, admin.post(
                    f"{root}/admin/models/{RELOADED}/reload", json={"revision": args.revision}) as resp:
                status, text = resp.status, await resp.text()
            try:
                answer = json.loads(text)
            except ValueError:
                answer = text
        except aiohttp.ClientError as e:
            status, answer = None, f"{type(e).__name__}: {e}"
        end = time.perf_counter()
        load.deadline = end + args.after
        await running
        cpu = cpu_usage(cpu0, cpu_snapshot(pid))
    rs, ra = start - t0, end - t0  # the reload's start and answer, in the phase's seconds
    records = load.records

    def ttfts(rows: list[RequestRecord]) -> dict[str, Any]:
        values = [r.ttft for r in rows if r.ok and r.ttft is not None]
        return {"requests": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
                "max": max(values) if values else None}

    before = [r for r in records if rs - args.before <= r.send_time and r.send_time + (r.ttft or math.inf) < rs]
    loading = [r for r in records if rs <= r.send_time < ra]
    swapped = [r for r in records if ra <= r.send_time < ra + args.after]
    across = [r for r in records if r.send_time < ra < r.send_time + r.elapsed]  # in flight at the swap
    headers = {  # by when the request was sent: before the reload, while it loaded, after its answer
        "before": Counter(h for t, h in seen if t < start),
        "loading": Counter(h for t, h in seen if start <= t < end),
        "after": Counter(h for t, h in seen if t >= end),
    }
    return {
        "status": status, "answer": answer, "reload_s": end - start, "cpu": cpu,
        "before": ttfts(before), "during": ttfts(loading + swapped), "loading": ttfts(loading),
        "after_swap": ttfts(swapped), "requests": len(records), **failures(load),
        "in_flight_at_swap": len(across), "in_flight_at_swap_failed": sum(not r.ok for r in across),
        "headers": {k: dict(v) for k, v in headers.items()},
        "responses": len(seen),
    }


# ------------------------------------------------------------------------------ the run


async def wait_ready(root: str, seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    async with client_session() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{root}/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    sys.exit(f"{root}/ready did not answer 200 within {seconds:.0f} s")


async def warm_up(root: str, args: argparse.Namespace) -> None:
    """One round of --concurrency requests on each model at once; every one must succeed."""
    async with client_session() as session:
        t0 = time.perf_counter()
        workload = Workload(seed=1, input_len=PROMPT_TOKENS, output_len=args.max_tokens)
        records = await asyncio.gather(*(
            send(session, f"{root}/v1/completions",
                 request_body(workload.spec(i, f"warmup-{m}"), m, chat=False, ignore_eos=True),
                 RequestRecord(index=i), api_key=None, t0=t0)
            for m in MODELS for i in range(args.concurrency)))
    if bad := [r for r in records if not r.ok]:
        sys.exit(f"warm-up: {len(bad)} of {len(records)} requests failed, e.g. {bad[0].error}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    with TemporaryDirectory() as d, inferd_serve(Path(d), "models", server_config(args)) as (proc, _, root):
        asyncio.run(wait_ready(root))
        log = (Path(d) / "models.log").read_text()
        results["served"] = [(line.name, line.dtype) for line in StartupLine.parse_all(log)]
        print(f"serving {', '.join(f'{m} ({dt})' for m, dt in results['served'])} at {root}", flush=True)
        asyncio.run(warm_up(root, args))
        print(f"1. throughput: {args.concurrency} streams per model x {args.max_tokens} tokens, "
              f"{args.seconds:g} s per phase (tok/s over its last {1 - WINDOW_SKIP:.0%})", flush=True)
        phases = []
        for name, models in (("a alone", ("a",)), ("b alone", ("b",)), ("together", MODELS)):
            phase = asyncio.run(throughput_phase(root, models, args, proc.pid, name))
            phases.append(phase)
            for m, row in phase["models"].items():
                print(f"   {name:<9} {m}: {row['tok_s']:7.1f} tok/s, {row['requests']} requests, "
                      f"TTFT p50 {fmt_s(row['ttft_p50'])}, TPOT p50 {fmt_s(row['tpot_p50'])}, "
                      f"failed {row['failed']}, short {row['short']}", flush=True)
            print(f"   {'':<9} CPU: {cpu_line(phase['cpu'])}", flush=True)
        results["throughput"] = phases
        print(f"2. reload: {args.concurrency} streams on {RELOADED} x {args.reload_max_tokens} tokens; "
              f"the reload after {args.settle + args.before:g} s, the load until {args.after:g} s after its answer",
              flush=True)
        reload = asyncio.run(reload_phase(root, args, proc.pid))
        results["reload"] = reload
        print(f"   POST /admin/models/{RELOADED}/reload -> {reload['status']} in {reload['reload_s']:.2f} s: "
              f"{json.dumps(reload['answer'])[:300]}", flush=True)
    return results


# ------------------------------------------------------------------------------ the report


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def cpu_line(cpu: dict[str, float]) -> str:
    wall = cpu["wall_s"] or 1.0
    return (f"server {cpu['server_cpu_s'] / wall:.2f} cores, client {cpu['client_cpu_s'] / wall:.2f}, "
            f"other processes {cpu['other_cpu_s'] / wall:.2f} (of {cpu['cores']})")


def machine() -> str:
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "?"
    return f"{name}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch}"


def problems(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out = []
    for phase in results["throughput"]:
        for m, row in phase["models"].items():
            if row["chunks_not_tokens"]:  # tok/s counts token events: it assumes one token each
                out.append(f"{phase['phase']}, {m}: {row['chunks_not_tokens']} requests had fewer token events "
                           "than tokens, so its tok/s is undercounted")
            if row["failed"] or row["short"]:
                out.append(f"{phase['phase']}, {m}: {row['failed']} failed {row['by_type']}, {row['short']} short"
                           + (f" (e.g. {row['example']})" if row["example"] else ""))
    r = results["reload"]
    if r["status"] != 200 or not (isinstance(r["answer"], dict) and r["answer"].get("reloaded")):
        out.append(f"the reload answered {r['status']}: {r['answer']}")
    if r["failed"] or r["short"]:
        out.append(f"reload phase: {r['failed']} failed {r['by_type']}, {r['short']} short"
                   + (f" (e.g. {r['example']})" if r["example"] else ""))
    new, old = f"{RELOADED}@{args.revision}", f"{RELOADED}@r1"
    if set(r["headers"]["after"]) != {new}:
        out.append(f"responses sent after the reload's answer carried {r['headers']['after']}, not only {new}")
    if set(r["headers"]["before"]) != {old}:
        out.append(f"responses sent before the reload carried {r['headers']['before']}, not only {old}")
    return out


def report(results: dict[str, Any], args: argparse.Namespace, command: str) -> None:
    phases = {p["phase"]: p for p in results["throughput"]}
    alone = {m: phases[f"{m} alone"]["models"][m]["tok_s"] for m in MODELS}
    together = phases["together"]["models"]
    both = sum(together[m]["tok_s"] for m in MODELS)
    r = results["reload"]
    dtypes = ", ".join(sorted({dt for _, dt in results["served"]}))
    print(f"\n## Two models in one server (issue 12)\n\n```sh\n{command}\n```\n")
    print(f"{machine()}; {datetime.date.today().isoformat()}. One `inferd serve`, models a and b: both the "
          f"default GGUF in {dtypes}, {args.kv_cache_memory} of KV cache each, shedding off. Streaming "
          f"/v1/completions, greedy, EOS ignored, ~{PROMPT_TOKENS}-token prompts, closed loop.\n")
    print(f"**Throughput**: {args.concurrency} streams per model x {args.max_tokens} tokens, {args.seconds:g} s "
          f"a phase; output tok/s over the phase's last {1 - WINDOW_SKIP:.0%}.\n")
    print("| phase | model | requests | output tok/s | vs alone | TTFT p50 | TPOT p50 | other processes' CPU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, phase in phases.items():
        cpu = phase["cpu"]
        other = f"{cpu['other_cpu_s'] / (cpu['wall_s'] or 1):.2f} cores"
        for m, row in phase["models"].items():
            ratio = f"{row['tok_s'] / alone[m]:.2f}x" if alone[m] else "-"
            print(f"| {name} | {m} | {row['requests']} | {row['tok_s']:.1f} | {ratio} | {fmt_s(row['ttft_p50'])} "
                  f"| {fmt_s(row['tpot_p50'])} | {other} |")
    mean_alone = sum(alone.values()) / len(alone)
    print(f"| together | a+b | {sum(together[m]['requests'] for m in MODELS)} | {both:.1f} | "
          f"{both / mean_alone:.2f}x | | | |\n")
    print(f"- a+b together / one model alone (the mean of a and b alone): **{both / mean_alone:.2f}x**; "
          f"/ the sum of both alone: {both / sum(alone.values()):.2f}x.")
    print("- per model, together / alone: " + ", ".join(
        f"{m} {together[m]['tok_s'] / alone[m]:.2f}x" for m in MODELS if alone[m]) + ".")
    print(f"- the two engine threads share {os.cpu_count()} cores: each model's share of them is what it gets.\n")
    print(f"**Reload**: {args.concurrency} streams on {RELOADED} x {args.reload_max_tokens} tokens; "
          f"POST /admin/models/{RELOADED}/reload {{\"revision\": \"{args.revision}\"}} after {args.before:g} s "
          f"of load; \"during\" = requests sent from the reload's start to {args.after:g} s after its answer.\n")
    print("| requests sent | requests | TTFT p50 | TTFT p99 | TTFT max |")
    print("|---|---:|---:|---:|---:|")
    for key, label in (("before", f"before the reload ({args.before:g} s)"),
                       ("during", f"during: reload start -> answer + {args.after:g} s"),
                       ("loading", "  of which while it loaded"), ("after_swap", "  of which after the swap")):
        t = r[key]
        print(f"| {label} | {t['requests']} | {fmt_s(t['p50'])} | {fmt_s(t['p99'])} | {fmt_s(t['max'])} |")
    p99_before, p99_during = r["before"]["p99"], r["during"]["p99"]
    if p99_before and p99_during:
        print(f"\n- p99 TTFT during / before: **{p99_during / p99_before:.2f}x**.")
    print(f"- the reload: HTTP {r['status']} in **{r['reload_s']:.2f} s** (load, start, probe, swap).")
    print(f"- failed requests: **{r['failed']}** of {r['requests']}"
          + (f" {r['by_type']}" if r["failed"] else "") + f"; short (fewer tokens than asked): "
          f"{r['short']}; in flight at the swap: {r['in_flight_at_swap']}, of which failed "
          f"{r['in_flight_at_swap_failed']}.")
    h = r["headers"]
    print(f"- x-inferd-model, by when the request was sent: before the reload {h['before']}; while it loaded "
          f"{h['loading']}; after its answer {h['after']}.")
    print(f"- CPU during the reload phase: {cpu_line(r['cpu'])}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: short phases (not for recording)")
    parser.add_argument("--concurrency", type=int, default=8, help="streams per model")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens a request, throughput phases")
    parser.add_argument("--seconds", type=float, default=60.0, help="each throughput phase")
    parser.add_argument("--reload-max-tokens", type=int, default=16, help="output tokens a request, reload phase")
    parser.add_argument("--before", type=float, default=20.0, help="seconds of load measured before the reload")
    parser.add_argument("--after", type=float, default=5.0, help="seconds of load after the reload's answer")
    parser.add_argument("--revision", default="r2", help="the revision the reload names")
    parser.add_argument("--dtype", help="both models' dtype (default: the server's)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="each model's KV cache")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    args.settle = SETTLE_SECONDS
    if args.quick:
        args.seconds, args.before, args.after, args.settle = 10.0, 6.0, 3.0, 2.0
    command = ".venv/bin/python bench/models.py" + "".join(f" {a}" for a in sys.argv[1:])
    started = time.perf_counter()
    results = run(args)
    report(results, args, command)
    print(f"\n(the whole run: {time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if bad := problems(results, args):
        print("\nFAILED:\n" + "\n".join(f"- {p}" for p in bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
