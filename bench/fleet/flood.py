"""A flood: N requests at once against a fresh `inferd serve` on its default limits (the embedded
model), each on its own connection. What must hold: every request answered (200, or 429/503 with
Retry-After), no 5xx, no hang, and the KV pool whole afterwards.

    .venv/bin/python bench/fleet/flood.py [--requests 400] [--max-tokens 32]

Prints the statuses with their latency (min / median / max), the refusals without Retry-After,
and the server's /v1/status counts after (blocks used, rejections, shedding).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import subprocess
import threading
import time
from typing import Any

import aiohttp


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([".venv/bin/inferd", "serve", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    url = None
    for line in proc.stdout:
        if url is None and (m := re.search(r"http://127\.0\.0\.1:[1-9]\d*", line)):
            url = m.group(0)
        if url and "ready" in line:
            break
    assert url, "the server did not come up"
    # NOTE: its log is read to the end in a thread: a full pipe would stall the server's writes
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return proc, url


async def flood(url: str, requests: int, max_tokens: int) -> tuple[list[tuple[Any, str | None, float]], dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        async with session.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def one(i: int) -> tuple[Any, str | None, float]:
            body = {"model": model, "prompt": f"Request {i}: tell me about the sea.", "max_tokens": max_tokens,
                    "temperature": 0}
            start = time.monotonic()
            try:
                async with session.post(f"{url}/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=300)) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After"), time.monotonic() - start
            except (aiohttp.ClientError, TimeoutError) as e:
                return type(e).__name__, None, time.monotonic() - start

        results = await asyncio.gather(*(one(i) for i in range(requests)))
        async with session.get(f"{url}/v1/status") as r:
            return list(results), await r.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    proc, url = start_server()
    try:
        started = time.monotonic()
        results, status = asyncio.run(flood(url, args.requests, args.max_tokens))
        print(f"{args.requests} requests at once against {url}: all answered in {time.monotonic() - started:.1f} s")
        for code, n in sorted(collections.Counter(r[0] for r in results).items(), key=str):
            times = sorted(t for c, _, t in results if c == code)
            print(f"  {code}: {n}, latency {times[0]:.2f} / {times[len(times) // 2]:.2f} / {times[-1]:.2f} s")
        print(f"  refusals without Retry-After: {sum(1 for c, ra, _ in results if c in (429, 503) and not ra)}")
        print(f"  after: kv_blocks_used {status['kv_blocks_used']}, running {status['running']}, waiting "
              f"{status['waiting']}, rejections {status['rejections']}, shed_level {status['shed_level']}")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
