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
3. every seat taken (`--scenario seats`): `a` keeps 2 x max_num_seqs streams open, each asking
   exactly --heavy-tokens (64, then 512), so they start and end in waves; `b` sends one 8-token
   request every --light-interval seconds (0.5) from 5 s in. Reported: b's p95 TTFT against a's
   (claim <= 1/3; a request of a's still waiting at the cut counts with what it waited) and
   against an unloaded request's TTFT + 2 loaded steps (a's TPOT p50); a's tokens / s, and a's +
   b's, against a run of a alone (claim: a within 10%); fairness preemptions per minute (from
   /metrics). b's demand at 0.5 s is 16 tokens a second, a share of the machine that depends on
   the machine: for the same share on a slower CPU, --light-interval grows by the ratio of the
   two machines' throughputs (b's demand against a alone's is printed).

    .venv/bin/python bench/fairness.py --scenario seats --max-num-seqs 64 --seconds 40
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
    streamed: int = 0  # completion tokens seen so far (one per event: greedy, no stop strings)
    last: float | None = None  # seconds after the send of the latest token event


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
            if event.get("choices"):
                sample.streamed += 1
                sample.last = time.perf_counter() - start
                if sample.ttft is None:
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


async def seats_taken(url: str, model: str, heavy_streams: int, heavy_tokens: int, seconds: float,
                      light_interval: float | None) -> dict[str, Any]:
    """Scenario 3 against one server: an unloaded request's TTFT first, then the load."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        unloaded = Sample("b", 0.0)
        await stream(session, url, model, unloaded, 8)
        before = await fair_preemptions(session, url)
        samples: list[Sample] = []
        t0 = time.perf_counter()

        async def heavy_worker() -> None:
            while (now := time.perf_counter() - t0) < seconds:
                samples.append(sample := Sample("a", now))
                await stream(session, url, model, sample, heavy_tokens)

        async def light_sender() -> None:
            sent = []
            await asyncio.sleep(5.0)
            while (now := time.perf_counter() - t0) < seconds:
                samples.append(sample := Sample("b", now))
                sent.append(asyncio.ensure_future(stream(session, url, model, sample, 8)))
                await asyncio.sleep(light_interval)
            await asyncio.gather(*sent)

        heavy = [asyncio.ensure_future(heavy_worker()) for _ in range(heavy_streams)]
        await (light_sender() if light_interval else asyncio.sleep(seconds))
        wall = time.perf_counter() - t0
        streamed = {t: sum(s.streamed for s in samples if s.tenant == t) for t in KEYS}  # (at the cut)
        for s in samples:  # a request still without a token at the cut waited at least this long
            if s.tenant == "a" and s.ttft is None:
                s.ttft = wall - s.sent
        after = await fair_preemptions(session, url)
        for task in heavy:
            task.cancel()
        await asyncio.gather(*heavy, return_exceptions=True)
    tpots = [(s.last - s.ttft) / (s.streamed - 1) for s in samples
             if s.tenant == "a" and s.streamed >= 2 and s.ttft is not None and s.last is not None]
    return {"a": ttft_row(samples, "a"), "b": ttft_row(samples, "b"), "unloaded_ttft": unloaded.ttft,
            "a_tpot_p50": percentile(tpots, 0.5), "a_tokens_per_second": streamed["a"] / wall,
            "b_tokens_per_second": streamed["b"] / wall,
            "fair_preemptions_per_minute": (after - before) * 60 / wall, "wall": wall}


async def fair_preemptions(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("inferd_tenant_fair_preemptions_total{"))


def seats_scenario(tmp: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    heavy = 2 * args.max_num_seqs
    for tokens in args.heavy_tokens:
        print(f"3. every seat taken: a keeps {heavy} streams of {tokens} tokens, b one 8-token request / "
              f"{args.light_interval} s "
              f"from 5 s, {args.seconds:.0f} s")
        rows = {}
        for label, fairness, light in (("alone", "vtc", False), ("fcfs", "fcfs", True), ("vtc", "vtc", True)):
            with inferd_serve(tmp, f"seats-{label}-{tokens}", config(fairness, args.max_num_seqs,
                                                                     {"a": 1, "b": 1})) as (_, model, url):
                rows[label] = row = asyncio.run(seats_taken(url, model, heavy, tokens, args.seconds,
                                                            args.light_interval if light else None))
            line = (f"   {label:<6} a {row['a_tokens_per_second']:6.1f} tok/s, a's TTFT p95 {row['a']['ttft_p95']:6.2f} s, "
                    f"TPOT p50 {row['a_tpot_p50'] * 1000:5.0f} ms")
            if light:
                line += (f"; b's TTFT p95 {row['b']['ttft_p95']:5.2f} s ({row['b']['requests']} requests), "
                         f"fair preemptions {row['fair_preemptions_per_minute']:.0f}/min")
            print(line)
        vtc, alone = rows["vtc"], rows["alone"]
        bound = vtc["unloaded_ttft"] + 2 * vtc["a_tpot_p50"]
        print(f"   vtc: b's p95 / a's p95 = {vtc['b']['ttft_p95'] / vtc['a']['ttft_p95']:.3f} (claim <= 0.333); "
              f"b's p95 {vtc['b']['ttft_p95']:.3f} s against unloaded TTFT + 2 steps = {bound:.3f} s; "
              f"a's throughput {vtc['a_tokens_per_second'] / alone['a_tokens_per_second']:.3f}x of alone, "
              f"a's + b's {(vtc['a_tokens_per_second'] + vtc['b_tokens_per_second']) / alone['a_tokens_per_second']:.3f}x; "
              f"b's demand {8 / args.light_interval / alone['a_tokens_per_second']:.3f} of a alone's")
        results[f"seats_{tokens}"] = rows


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
    parser.add_argument("--scenario", choices=("shares", "seats"), default="shares",
                        help="shares: 1 and 2 (the default); seats: 3, every seat taken")
    parser.add_argument("--heavy-tokens", type=int, nargs="+", default=[64, 512], help="scenario 3's answers")
    parser.add_argument("--light-interval", type=float, default=0.5, help="scenario 3: seconds between b's requests")
    args = parser.parse_args()
    heavy = 2 * args.max_num_seqs
    results: dict[str, Any] = {"args": vars(args) | {"json": None}}
    with TemporaryDirectory() as d:
        tmp = Path(d)
        if args.scenario == "seats":
            seats_scenario(tmp, args, results)
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
            return
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
