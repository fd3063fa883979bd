"""Models on demand under models_max (issue 46): two models taking turns in one slot of memory,
an idle one unloaded, a pinned one kept.

    .venv/bin/python bench/fleet/on_demand.py            # ~1-2 min on the 2-core machine

One `inferd serve` subprocess, three models, each the embedded SmolLM2-135M loaded from the file
on its first request (load = "on_demand"): `a` and `b` unpinned under [server] models_max = 1,
`p` pinned; all three unloaded after --idle s without a request (but the pinned one). Phases:

    start      the server is ready with no model loaded (/ready 200, the time to it)
    alternate  --rounds requests a, b, a, b, ... one after the other: each a switch (the other
               model unloaded first, then this one loaded); their statuses and latencies
    burst      --burst requests of each model at once: they wait for each other's model (no 5xx)
    pinned     `p` answers without unloading `a` or `b` (pinned models are not counted)
    idle       --idle s later: `a` and `b` unloaded, `p` still serving

Printed: requests answered, 5xx (must be 0), other failures, every model's loads, unloads and
switches, its loads' seconds and the requests that waited (from /v1/status), whether every KV pool
is whole (no block held once the requests ended), and the server's resident memory at each phase's
end (a model's weights and KV cache go when it unloads). Exit status 1 on a 5xx, a lost request, a
pool not whole, or a model in the wrong state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overload import inferd_serve  # noqa: E402  (bench/'s: `inferd serve` in a subprocess)

CONFIG = """[server]
probe_interval_seconds = 0
models_max = 1
model_load_wait_seconds = 120

[models.a]
load = "on_demand"
idle_unload_seconds = {idle}
kv_cache_memory = "{kv}"

[models.b]
load = "on_demand"
idle_unload_seconds = {idle}
kv_cache_memory = "{kv}"

[models.p]
load = "on_demand"
pinned = true
idle_unload_seconds = {idle}
kv_cache_memory = "{kv}"
"""


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def ask(session: aiohttp.ClientSession, url: str, model: str) -> dict[str, Any]:
    start = time.perf_counter()
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            answer = await r.json(content_type=None)
            return {"model": model, "status": r.status, "seconds": time.perf_counter() - start,
                    "answered_by": r.headers.get("x-inferd-model"),
                    "error": None if r.status == 200 else answer.get("error", {}).get("code")}
    except aiohttp.ClientError as e:
        return {"model": model, "status": None, "seconds": time.perf_counter() - start, "error": str(e)}


async def models(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with session.get(f"{url}/v1/status") as r:
        return {m["name"]: m for m in (await r.json())["models"]}


def summary(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [o["seconds"] for o in outcomes]
    return {"requests": len(outcomes), "answered": sum(o["status"] == 200 for o in outcomes),
            "5xx": sum((o["status"] or 0) >= 500 for o in outcomes),
            "other": sum(o["status"] not in (200,) and not (o["status"] or 0) >= 500 for o in outcomes),
            "errors": sorted({o["error"] for o in outcomes if o["error"]}),
            "seconds_p50": round(statistics.median(seconds), 2), "seconds_max": round(max(seconds), 2)}


async def run(url: str, pid: int, args: argparse.Namespace, ready_seconds: float) -> int:
    problems: list[str] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = await models(session, url)
        print(f"start: ready in {ready_seconds:.1f} s with states "
              f"{ {n: m['state'] for n, m in before.items()} }; RSS {rss_mib(pid):.0f} MiB")
        outcomes = [await ask(session, url, "ab"[i % 2]) for i in range(args.rounds)]
        print(f"alternate: {json.dumps(summary(outcomes))}; RSS {rss_mib(pid):.0f} MiB")
        burst = await asyncio.gather(*(ask(session, url, m) for m in "ab" * args.burst))
        print(f"burst: {json.dumps(summary(burst))}; RSS {rss_mib(pid):.0f} MiB")
        loaded = {n for n, m in (await models(session, url)).items() if m["state"] == "serving"}
        pinned = await ask(session, url, "p")
        after = await models(session, url)
        still = {n for n in loaded if after[n]["state"] == "serving"}
        print(f"pinned: p {pinned['status']} in {pinned['seconds']:.1f} s; {sorted(loaded)} still serving: "
              f"{sorted(still)}; RSS {rss_mib(pid):.0f} MiB")
        if pinned["status"] != 200 or still != loaded:
            problems.append("the pinned model's load unloaded another, or failed")
        all_outcomes = [*outcomes, *burst, pinned]
        await asyncio.sleep(args.idle + 2)
        final = await models(session, url)
        states = {n: m["state"] for n, m in final.items()}
        print(f"idle: after {args.idle + 2:.0f} s: {states}; RSS {rss_mib(pid):.0f} MiB")
        if states != {"a": "unloaded", "b": "unloaded", "p": "serving"}:
            problems.append(f"idle: states {states}")
    whole = all(m["kv_blocks_used"] == 0 for m in final.values())
    for name, m in final.items():
        life = m["life"]
        print(f"model {name}: loads {life['loads']}, unloads {life['unloads']}, switches {life['switches']}, "
              f"last load {life['load_seconds']:.2f} s, requests that waited {life['load_waits']} "
              f"(gave up {life['load_wait_timeouts']}), failures {life['load_failures']}")
    total = summary(all_outcomes)
    print(f"total: {total['answered']} of {total['requests']} answered, {total['5xx']} 5xx, {total['other']} other; "
          f"switches {sum(m['life']['switches'] for m in final.values())}; KV pools whole: {whole}")
    if total["answered"] != total["requests"]:
        problems.append(f"{total['requests'] - total['answered']} requests not answered: {total['errors']}")
    if not whole:
        problems.append("a KV pool is not whole")
    for problem in problems:
        print(f"FAIL: {problem}")
    return int(bool(problems))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="alternating requests a, b, a, ...")
    parser.add_argument("--burst", type=int, default=4, help="requests of each model sent at once")
    parser.add_argument("--idle", type=float, default=6.0, help="idle_unload_seconds of every model")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        config = CONFIG.format(idle=args.idle, kv=args.kv_cache_memory)
        with inferd_serve(Path(tmp), "on_demand", config) as (proc, _, url):
            ready = wait_ready(url) - started
            status = asyncio.run(run(url, proc.pid, args, ready))
    sys.exit(status)


def wait_ready(url: str) -> float:
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter()
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit("the server never became ready")


if __name__ == "__main__":
    main()
