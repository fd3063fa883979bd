"""A soak: mixed traffic against a real `inferd serve` for a long time, then a check that what
it held came back.

    python bench/soak.py --minutes 30 [--json soak.json]

Two tenants (alpha at tight rate limits, beta looser) send, from 8 closed-loop workers: streams
and whole replies, streams dropped mid-way, resumable streams dropped and resumed, structured
outputs, tool calls. Halfway, inferd.toml changes beta's limits and the server gets a SIGHUP.
Every 15 s the server's resident memory, file descriptors, threads, KV blocks in use and held
resumable streams are sampled. After a warm-up (a minute of the same traffic, a tenth of a
short run; then idle) the idle values are read; after the traffic stops and the server is idle
again they must be back: no KV block or resumable stream held, file descriptors and threads
no more than at the warm-up's end, and the resident memory grown less than 5% from its value
after the first five minutes (a third of the run, for a run shorter than 15 minutes). Exit
status 1 if any of that fails.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from overload import inferd_serve  # (bench/: the script's own folder is on sys.path)

KEYS = {"alpha": "sk-soak-alpha", "beta": "sk-soak-beta"}
MODEL = "smollm2"
WORKERS = 8
SAMPLE_SECONDS = 15.0
RECIPE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "servings": {"type": "integer", "minimum": 1, "maximum": 8}},
          "required": ["name", "servings"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}
KINDS = ("stream", "whole", "disconnect", "resume", "structured", "tool_call")


def config(beta_rps: float) -> str:
    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    return (f'[model]\nname = "{MODEL}"\n'
            '[cache]\nkv_cache_memory = "128MiB"\n'
            '[scheduler]\nmax_num_seqs = 16\n'
            '[server]\nresume_grace_seconds = 5.0\n'
            f'[tenants.alpha]\nkey_sha256 = ["{digest(KEYS["alpha"])}"]\nrequests_per_second = 1.5\n'
            'tokens_per_second = 400\n'
            f'[tenants.beta]\nkey_sha256 = ["{digest(KEYS["beta"])}"]\nrequests_per_second = {beta_rps}\n')


@dataclass
class Sample:
    at: float  # seconds since the traffic started
    rss_mib: float
    fds: int
    threads: int
    kv_blocks_used: float
    resumable_streams: float


@dataclass
class Report:
    minutes: float
    requests: Counter[str] = field(default_factory=Counter)  # by kind
    outcomes: Counter[str] = field(default_factory=Counter)  # "200", "429 rate_limit_requests", ...
    samples: list[Sample] = field(default_factory=list)
    idle_before: Sample | None = None
    idle_after: Sample | None = None
    reload: str = ""
    failures: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------ the server

def process_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


async def sample(session: aiohttp.ClientSession, url: str, pid: int, at: float) -> Sample:
    async with session.get(f"{url}/metrics") as r:
        metrics = await r.text()

    def metric(name: str) -> float:
        return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))

    status = process_status(pid)
    return Sample(at=round(at, 1), rss_mib=round(int(status["VmRSS"].split()[0]) / 1024, 1),
                  fds=len(os.listdir(f"/proc/{pid}/fd")), threads=int(status["Threads"]),
                  kv_blocks_used=metric("inferd_kv_blocks_used"), resumable_streams=metric("inferd_resumable_streams"))


async def idle_sample(url: str, pid: int, at: float) -> Sample:
    """A sample once the server is idle, on a fresh connection pool (the traffic's closed): the
    idle inference probe, if it runs just then, holds a block for a moment, so look again."""
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(1.0)
        for _ in range(20):
            s = await sample(session, url, pid, at)
            if not s.kv_blocks_used:
                break
            await asyncio.sleep(0.5)
        return s


async def until_idle(session: aiohttp.ClientSession, url: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        async with session.get(f"{url}/v1/status", headers=auth("beta")) as r:
            body = await r.json()
        async with session.get(f"{url}/metrics") as r:
            held = next(float(line.split()[-1]) for line in (await r.text()).splitlines()
                        if line.startswith("inferd_resumable_streams "))
        if body["running"] == body["waiting"] == body["kv_blocks_used"] == 0 and held == 0:
            return
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------ the traffic

def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def one(session: aiohttp.ClientSession, url: str, kind: str, tenant: str, rng: random.Random) -> str:
    """One request of `kind` as `tenant`; its outcome ("200", or the status and error code)."""
    tokens = rng.randint(8, 40)
    prompt = f"Request {rng.randint(0, 10**6)}: tell me about the sea."
    completion = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0.8,
                  "seed": rng.randint(0, 1000)}
    messages = [{"role": "user", "content": prompt}]
    if kind == "whole":
        return await post(session, f"{url}/v1/chat/completions", tenant,
                          {"model": MODEL, "messages": messages, "max_tokens": tokens})
    if kind == "structured":
        return await post(session, f"{url}/v1/chat/completions", tenant, {
            "model": MODEL, "messages": messages, "max_tokens": 96, "response_format": {
                "type": "json_schema", "json_schema": {"name": "recipe", "schema": RECIPE, "strict": True}}})
    if kind == "tool_call":
        return await post(session, f"{url}/v1/chat/completions", tenant, {
            "model": MODEL, "messages": messages, "max_tokens": 64, "tools": [WEATHER], "tool_choice": "required"})
    body = {**completion, "stream": True, "resumable": kind == "resume"}
    async with session.post(f"{url}/v1/completions", json=body, headers=auth(tenant)) as r:
        if r.status != 200:
            return await outcome(r)
        event_id = None
        async for line in r.content:
            if line.startswith(b"id: "):
                event_id = line[4:].decode().strip()
            if kind in ("disconnect", "resume") and event_id is not None and line == b"\n":
                break  # gone after its first event
            if line.startswith(b"data: [DONE]"):
                return "200"
    if kind == "disconnect":
        return "200 dropped"
    assert event_id is not None
    stream_id = event_id.rsplit(":", 1)[0]
    await asyncio.sleep(rng.uniform(0.1, 2.0))
    async with session.get(f"{url}/v1/streams/{stream_id}", headers={**auth(tenant), "Last-Event-ID": event_id}) as r:
        if r.status != 200:
            return "resume " + await outcome(r)
        text = await r.text()
    return "200 resumed" if text.rstrip().endswith("data: [DONE]") else "resume cut"


async def post(session: aiohttp.ClientSession, url: str, tenant: str, body: dict[str, Any]) -> str:
    async with session.post(url, json=body, headers=auth(tenant)) as r:
        if r.status != 200:
            return await outcome(r)
        reply = await r.json()
        if body.get("response_format"):
            json.loads(reply["choices"][0]["message"]["content"])  # (raises: a broken answer fails the soak)
        return "200"


async def outcome(r: aiohttp.ClientResponse) -> str:
    try:
        code = (await r.json(content_type=None))["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "?"
    return f"{r.status} {code}"


async def worker(session: aiohttp.ClientSession, url: str, rng: random.Random, until: float, report: Report) -> None:
    while time.monotonic() < until:
        kind, tenant = rng.choice(KINDS), rng.choice(("alpha", "beta"))
        report.requests[kind] += 1
        result = await one(session, url, kind, tenant, rng)
        report.outcomes[result] += 1
        if result.startswith("429"):
            await asyncio.sleep(rng.uniform(0.2, 1.0))  # as a client honouring Retry-After would, roughly


async def soak(minutes: float, folder: Path, seed: int = 0) -> Report:
    report = Report(minutes)
    with inferd_serve(folder, "inferd", config(beta_rps=8)) as (proc, _, url):  # (bench/overload.py's)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            # the warm-up: the same traffic, not counted (the pools it grows to their working size
            # are the idle values), then idle
            warm_until = time.monotonic() + min(60.0, minutes * 6)
            await asyncio.gather(*(worker(session, url, random.Random(-i - 1), warm_until, Report(0))
                                   for i in range(WORKERS)))
            await until_idle(session, url)
        report.idle_before = await idle_sample(url, proc.pid, 0.0)
        start = time.monotonic()
        until = start + minutes * 60
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            workers = [asyncio.ensure_future(worker(session, url, random.Random(seed + i + 1), until, report))
                       for i in range(WORKERS)]
            reloaded = False
            while not all(w.done() for w in workers):
                await asyncio.wait(workers, timeout=min(SAMPLE_SECONDS, max(1.0, until - time.monotonic())))
                now = time.monotonic() - start
                if report.samples and now - report.samples[-1].at < SAMPLE_SECONDS and not all(
                        w.done() for w in workers):
                    continue
                if not reloaded and now >= minutes * 30:
                    (folder / "inferd.toml").write_text(config(beta_rps=6))
                    proc.send_signal(signal.SIGHUP)
                    reloaded = True
                report.samples.append(await sample(session, url, proc.pid, now))
            for w in workers:
                w.result()  # (a worker's exception fails the soak)
            await until_idle(session, url)
        report.idle_after = await idle_sample(url, proc.pid, time.monotonic() - start)
        log = (folder / "inferd.log").read_text()  # (where inferd_serve writes it)
        report.reload = next((line for line in log.splitlines() if "SIGHUP: keys reloaded" in line), "")
    judge(report)
    return report


def judge(report: Report) -> None:
    before, after, fail = report.idle_before, report.idle_after, report.failures.append
    assert before is not None and after is not None
    if after.kv_blocks_used or after.resumable_streams:
        fail(f"held after the soak: {after.kv_blocks_used:g} KV blocks, {after.resumable_streams:g} resumable streams")
    if after.fds > before.fds:
        fail(f"file descriptors: {before.fds} idle before, {after.fds} after")
    if after.threads > before.threads:
        fail(f"threads: {before.threads} idle before, {after.threads} after")
    warm_until = min(300.0, report.minutes * 20)  # five minutes, or a third of a short run
    warm = next((s for s in report.samples if s.at >= warm_until), None)
    if warm is not None and after.rss_mib > warm.rss_mib * 1.05:
        fail(f"resident memory grew {after.rss_mib / warm.rss_mib - 1:.1%} after {warm.at:.0f} s "
             f"({warm.rss_mib} -> {after.rss_mib} MiB)")
    if not report.reload:
        fail("the SIGHUP reload was not logged")
    errors = {k: v for k, v in report.outcomes.items() if k.startswith("5") or k.endswith("cut") or "?" in k}
    if errors:
        fail(f"server errors: {errors}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferd-soak-") as tmp:
        report = asyncio.run(soak(args.minutes, Path(tmp), args.seed))
    print(f"soak: {args.minutes:g} min, {sum(report.requests.values())} requests {dict(report.requests)}")
    print(f"outcomes: {dict(report.outcomes.most_common())}")
    print("   at s   RSS MiB   fds  threads  KV used  resumable")
    for s in [report.idle_before, *report.samples, report.idle_after]:
        assert s is not None
        print(f"{s.at:7.0f} {s.rss_mib:9.1f} {s.fds:5d} {s.threads:8d} {s.kv_blocks_used:8g} {s.resumable_streams:10g}")
    print(f"reload: {report.reload.strip() or '-'}")
    print("PASS" if not report.failures else "FAIL:\n  " + "\n  ".join(report.failures))
    if args.json:
        # NOTE: not asdict(report) whole: it rebuilds a Counter from its (key, count) pairs as keys
        samples = [asdict(s) for s in (report.idle_before, *report.samples, report.idle_after) if s is not None]
        args.json.write_text(json.dumps({"minutes": report.minutes, "requests": dict(report.requests),
                                         "outcomes": dict(report.outcomes), "samples": samples,
                                         "reload": report.reload, "failures": report.failures}, indent=1))
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
