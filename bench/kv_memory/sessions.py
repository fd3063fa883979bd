"""Session retention (issue 43), served: `inferd serve` on the default model, no tenants, a small
KV pool, real HTTP (streamed chat completions), nothing else running.

    .venv/bin/python bench/kv_memory/sessions.py [--pool-mib 560] [--only resume,replay]

(a) resume: a ~1.5k-token conversation with `prompt_cache_key`, then anonymous chats of 3x the
    pool's tokens, a 5 s pause, and the conversation's next turn: the share of the first turn's
    prompt tokens that its next turn got from the cache (usage.prompt_tokens_details.cached_tokens;
    target >= 80%). The same conversation without a key, in the same run, for contrast.
(b) replay: 8 sessions (an ~600-token system prompt of its own each, 5 turns, each later turn
    adding a ~150-token tool result), a round of one turn each (staggered by 1 s, so a turn's TTFT
    is its own prefill's), then a 5 s tool pause; from the second pause on, anonymous chats of the
    pool's size run in it (enough to evict a prefix nobody holds). Each later turn's TTFT against
    its session's second turn's (target <= 1.5x), with keys (retention) and without, each on a
    fresh server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: peers/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inferd.client.bench_workload import WORDS  # noqa: E402
from inferd.model.loading.loader import default_model_path  # noqa: E402
from peers.servers import Server, inferd_server  # noqa: E402

TOKENS_PER_WORD = 1.3  # the default tokenizer on bench_workload's prose, roughly


def prose(seed: int, tokens: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens / TOKENS_PER_WORD)))


async def chat(s: aiohttp.ClientSession, server: Server, messages: list[dict], max_tokens: int,
               key: str | None) -> dict:
    """One streamed greedy chat: its answer, TTFT, prompt and cached tokens."""
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if key is not None:
        body["prompt_cache_key"] = key
    start, ttft, text, usage = time.perf_counter(), None, [], {}
    async with s.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["delta"]["content"])
            usage = event.get("usage") or usage
    return {"text": "".join(text), "ttft": ttft if ttft is not None else time.perf_counter() - start,
            "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "miss": (usage.get("prompt_cache") or {}).get("miss")}


async def anonymous(s: aiohttp.ClientSession, server: Server, tokens: int, seed: int, size: int = 500) -> None:
    """Distinct one-token chats of `size` prompt tokens, 4 at a time, `tokens` in all."""
    prompts = [prose(seed * 10_000 + i, size) for i in range(max(1, tokens // size))]
    gate = asyncio.Semaphore(4)

    async def one(text: str) -> None:
        async with gate:
            await chat(s, server, [{"role": "user", "content": text}], 1, None)

    await asyncio.gather(*(one(p) for p in prompts))


async def resume(server: Server, pool_tokens: int) -> list[str]:
    lines = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        for key, seed in (("conversation-1", 1), (None, 2)):
            messages = [{"role": "system", "content": "You are a careful reader. " + prose(seed, 1100)},
                        {"role": "user", "content": "Summarize this passage: " + prose(seed + 100, 400)}]
            first = await chat(s, server, messages, 24, key)
            await anonymous(s, server, 3 * pool_tokens, seed)
            await asyncio.sleep(5)
            messages += [{"role": "assistant", "content": first["text"]},
                         {"role": "user", "content": "And in one sentence?"}]
            second = await chat(s, server, messages, 8, key)
            share = second["cached"] / first["prompt"]
            lines.append(f"| {'prompt_cache_key' if key else 'no key'} | {first['prompt']} | {second['prompt']} | "
                         f"{second['cached']} | **{share:.0%}** | {second['miss']} |")
    return lines


async def session(s: aiohttp.ClientSession, server: Server, i: int, keyed: bool, rounds: list[asyncio.Event],
                  done: list[asyncio.Barrier], gap: float) -> list[dict]:
    messages = [{"role": "system", "content": f"You are agent {i}. Follow these rules. " + prose(1000 + i, 600)},
                {"role": "user", "content": "Start the task: list the files."}]
    turns = []
    for turn in range(len(rounds)):
        await rounds[turn].wait()
        await asyncio.sleep(i * gap)  # (staggered: a turn's TTFT is its own prefill, not its neighbours')
        answer = await chat(s, server, messages, 16, f"session-{i}" if keyed else None)
        turns.append(answer)
        messages += [{"role": "assistant", "content": answer["text"]},
                     {"role": "user", "content": "Tool result: " + prose(2000 + 10 * i + turn, 150)}]
        await done[turn].wait()
    return turns


async def replay(server: Server, pool_tokens: int, keyed: bool, sessions: int = 8, turns: int = 5,
                 gap: float = 1.0) -> list[list[dict]]:
    """Rounds of one turn per session; after the second round, each tool pause also carries
    anonymous chats of the pool's size (so turn 2 is a hit either way, and later turns only where
    something holds the prefix)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        rounds = [asyncio.Event() for _ in range(turns)]
        done = [asyncio.Barrier(sessions + 1) for _ in range(turns)]
        tasks = [asyncio.create_task(session(s, server, i, keyed, rounds, done, gap)) for i in range(sessions)]
        for turn in range(turns):
            rounds[turn].set()
            await done[turn].wait()
            if turn < turns - 1:  # the tool pause: 5 s (with anonymous traffic from the second on)
                await asyncio.gather(asyncio.sleep(5), anonymous(s, server, pool_tokens if turn else 0, 100 + turn))
        return list(await asyncio.gather(*tasks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-mib", type=int, default=560)
    parser.add_argument("--only", default="resume,replay")
    args = parser.parse_args()
    parts = args.only.split(",")
    pool_tokens = args.pool_mib * 2**20 // 23_040  # bfloat16 K and V of the default model: 23,040 bytes a token
    extra = ["--kv-cache-memory", f"{args.pool_mib}MiB", "--speculative", "off"]
    with tempfile.TemporaryDirectory() as tmp:
        if "resume" in parts:
            with inferd_server(Path(tmp), Path(tmp), default_model_path(), extra) as server:
                lines = asyncio.run(resume(server, pool_tokens))
            print(f"(a) resume after anonymous chats of 3x the pool ({pool_tokens} tokens) and a 5 s pause")
            print("| conversation | first turn's prompt | next turn's prompt | of which cached | share of the first "
                  "| miss |\n|---|---:|---:|---:|---:|---|")
            print("\n".join(lines))
        if "replay" in parts:
            print(f"(b) replay: 8 sessions, 5 turns, 5 s tool pauses; from the second on, anonymous chats of "
                  f"{pool_tokens} tokens in each")
            print("| sessions | turn 2 TTFT (median) | later turns' TTFT / turn 2's: median | max | later turns <= 1.5x "
                  "| later turns' prompt from cache | their misses |\n|---|---:|---:|---:|---:|---:|---|")
            for keyed in (True, False):
                with inferd_server(Path(tmp), Path(tmp), default_model_path(), extra) as server:
                    runs = asyncio.run(replay(server, pool_tokens, keyed))
                ratios = [t["ttft"] / s[1]["ttft"] for s in runs for t in s[2:]]
                later = [t for s in runs for t in s[2:]]
                cached = sum(t["cached"] for t in later) / sum(t["prompt"] for t in later)
                misses = sorted({str(t["miss"]).split(" at ")[0] for t in later})
                print(f"| {'prompt_cache_key' if keyed else 'no key'} | "
                      f"{statistics.median(s[1]['ttft'] for s in runs):.2f} s | {statistics.median(ratios):.2f}x "
                      f"| {max(ratios):.2f}x | {sum(r <= 1.5 for r in ratios)}/{len(ratios)} | {cached:.0%} "
                      f"| {', '.join(misses)} |")

if __name__ == "__main__":
    main()
