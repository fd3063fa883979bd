"""Fair sharing between tenants inside one class (issue 13): first-come order against VTC.

    .venv/bin/python bench/fairness.py                 # ~5 min on the 2-core machine
    .venv/bin/python bench/fairness.py --seconds 15    # a shorter run

Every run gets a fresh `inferd serve --config CONFIG` (the embedded SmolLM2-135M, the serving
defaults) with two tenants, `a` and `b`, in one class, and `scheduler.fairness` set to "fcfs" or
"vtc". Requests are streaming /v1/completions, greedy, EOS ignored, a ~32-token prompt and a
max_tokens drawn uniformly from [4, 2 x --max-tokens - 4] (seeded per stream), so seats free one by
one as in real traffic, not in waves of identical requests; each tenant runs closed-loop streams
(a stream sends its next request when the last one ends) for --seconds.

1. heavy against light: `a` runs 2 x max_num_seqs streams, `b` runs 4, equal weights. TTFT per
   tenant (client side: from the send to the first token event), p50 and p95; the claim is
   b's p95 <= a's p95 / 3 under VTC, where first-come order makes them about equal.
2. weights 2:1: `a` (weight 2) and `b` (weight 1) both run 2 x max_num_seqs streams (both always
   backlogged). Service tokens = prompt + completion tokens of each tenant's requests that ended
   inside the window (the first and last 10% of it cut, so the ramp does not count), from the
   client's usage events; the claim is a / b = 2 within +-15% under VTC.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import aiohttp

from overload import inferd_serve, percentile  # (bench/ is this script's folder)

KEYS = {"a": "sk-bench-tenant-a", "b": "sk-bench-tenant-b"}
PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
          "combined movable metal type with an oil-based ink and a screw press adapted from wine making.")


@dataclass
class Sample:
    tenant: str
    sent: float  # seconds since the run started
    ttft: float | None = None
    ended: float | None = None
    tokens: int = 0  # prompt + completion, from the usage event


def config(fairness: str, max_num_seqs: int, weights: dict[str, float]) -> str:
    tenants = "".join(
        f'[tenants.{name}]\nkey_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]\nweight = {weights[name]}\n\n'
        for name, key in KEYS.items())
    return (f'[scheduler]\nmax_num_seqs = {max_num_seqs}\nfairness = "{fairness}"\n\n'
            f"[shedding]\nenabled = false\n\n[server]\nprobe_interval_seconds = 0\n\n{tenants}")


async def stream(session: aiohttp.ClientSession, url: str, model: str, sample: Sample, max_tokens: int) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {KEYS[sample.tenant]}"}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices") and sample.ttft is None:
                sample.ttft = time.perf_counter() - start
            if event.get("usage"):
                sample.tokens = event["usage"]["total_tokens"]
    sample.ended = sample.sent + time.perf_counter() - start


async def closed_loop(url: str, model: str, streams: dict[str, int], seconds: float, max_tokens: int) -> list[Sample]:
    samples: list[Sample] = []
    t0 = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def worker(tenant: str, seed: int) -> None:
            rng = random.Random(seed)
            while (now := time.perf_counter() - t0) < seconds:
                samples.append(sample := Sample(tenant, now))
                await stream(session, url, model, sample, rng.randint(4, 2 * max_tokens - 4))

        await asyncio.gather(*(worker(t, i * 1000 + j) for i, (t, n) in enumerate(streams.items()) for j in range(n)))
    return samples


def ttft_row(samples: list[Sample], tenant: str) -> dict[str, Any]:
    ttfts = [s.ttft for s in samples if s.tenant == tenant and s.ttft is not None]
    return {"requests": len(ttfts), "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95)}


def service_tokens(samples: list[Sample], tenant: str, seconds: float) -> int:
    lo, hi = 0.1 * seconds, 0.9 * seconds
    return sum(s.tokens for s in samples if s.tenant == tenant and s.ended is not None and lo <= s.ended <= hi)


def run(tmp: Path, name: str, fairness: str, args: argparse.Namespace, streams: dict[str, int],
        weights: dict[str, float]) -> list[Sample]:
    with inferd_serve(tmp, name, config(fairness, args.max_num_seqs, weights)) as (_, model, url):
        return asyncio.run(closed_loop(url, model, streams, args.seconds, args.max_tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24, help="the mean max_tokens")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    heavy = 2 * args.max_num_seqs
    results: dict[str, Any] = {"args": vars(args) | {"json": None}}
    with TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"1. heavy against light: a runs {heavy} streams, b runs 4, equal weights, {args.seconds:.0f} s")
        print(f"   {'order':<6} {'tenant':<6} {'requests':>8} {'TTFT p50':>9} {'TTFT p95':>9}")
        for fairness in ("fcfs", "vtc"):
            samples = run(tmp, f"light-{fairness}", fairness, args, {"a": heavy, "b": 4}, {"a": 1, "b": 1})
            rows = {t: ttft_row(samples, t) for t in KEYS}
            results[f"light_{fairness}"] = rows
            for t, row in rows.items():
                print(f"   {fairness:<6} {t:<6} {row['requests']:>8} {row['ttft_p50']:>8.3f}s {row['ttft_p95']:>8.3f}s")
            print(f"   {fairness}: b's p95 / a's p95 = {rows['b']['ttft_p95'] / rows['a']['ttft_p95']:.3f}")
        print(f"2. weights 2:1, both run {heavy} streams, {args.seconds:.0f} s (service tokens in the middle 80%)")
        for fairness in ("fcfs", "vtc"):
            samples = run(tmp, f"weights-{fairness}", fairness, args, {"a": heavy, "b": heavy}, {"a": 2, "b": 1})
            a, b = (service_tokens(samples, t, args.seconds) for t in KEYS)
            results[f"weights_{fairness}"] = {"a_tokens": a, "b_tokens": b, "ratio": a / b}
            print(f"   {fairness:<6} a {a:>7} tokens, b {b:>7} tokens: a / b = {a / b:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
