"""served.py's parts: the copy-heavy completions (prompts, the client, their rate, where two
texts first differ) and speculation's counters on a server's /metrics."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from typing import Any

import aiohttp

from inferd.client.bench_workload import WORDS

from peers.servers import Server

PASSAGE_WORDS, PASSAGE_STEP = 90, 43  # passage i: 90 words of bench_workload's prose from word 43 i
REQUEST_TIMEOUT_S = 600.0
# speculation's counters on /metrics: (drafted, accepted) sample names, vLLM's and inferd's
SPEC_SAMPLES = (("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
                ("inferd_spec_drafted_tokens_total", "inferd_spec_accepted_tokens_total"))


class CopyError(Exception):
    pass


def passage(i: int) -> str:
    return " ".join(WORDS[(i * PASSAGE_STEP + k) % len(WORDS)] for k in range(PASSAGE_WORDS))


def copy_prompt(i: int) -> str:
    p = passage(i)
    return f"Passage: {p}\nThe same passage again: {p}\nAnd once more, word for word:"


async def complete(s: aiohttp.ClientSession, server: Server, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy, unstreamed completion: its text, completion tokens, seconds end to end, drafts."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"model": server.model} if server.model else {}
    t0 = time.perf_counter()
    async with s.post(f"{server.url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise CopyError(f"{server.side} /v1/completions: HTTP {resp.status}: {(await resp.text())[:300]}")
        data = await resp.json()
    usage, seconds = data.get("usage") or {}, time.perf_counter() - t0
    spec = usage.get("speculative") or {}
    return {"text": data["choices"][0]["text"], "tokens": usage.get("completion_tokens", 0), "seconds": seconds,
            "drafted": spec.get("drafted_tokens", 0), "accepted": spec.get("accepted_tokens", 0)}


async def copies(server: Server, n: int, max_tokens: int, repeats: int = 1, at_once: bool = False) -> list[dict]:
    """Passages 0..n-1, each `repeats` times one request after the other, or each once, all at once."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as s:
        if at_once:
            return list(await asyncio.gather(*(complete(s, server, copy_prompt(i), max_tokens) for i in range(n))))
        return [await complete(s, server, copy_prompt(i), max_tokens) for i in range(n) for _ in range(repeats)]


def copy_rate(runs: list[dict[str, Any]]) -> float:
    """Output tokens per second over requests made one after the other."""
    return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def first_difference(a: str, b: str) -> int | None:
    """The first character where `a` and `b` differ (None if equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def spec_counters(server: Server) -> tuple[float, float] | None:
    """(drafted, accepted) tokens from the server's /metrics (vLLM's or inferd's counters, summed
    over their labels), None without them."""
    try:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError:
        return None
    for names in SPEC_SAMPLES:
        if any(re.search(rf"^{re.escape(n)}", text, re.M) for n in names):
            drafted, accepted = (sum(float(v) for v in re.findall(rf"^{re.escape(n)}(?:{{[^}}]*}})?\s+(\S+)",
                                                                  text, re.M)) for n in names)
            return drafted, accepted
    return None
