"""The prefix cache's host tier (issue 43): a workload whose working set is 3x the KV pool, with
and without the tier, and with the tier's bytes given to the pool instead (the CPU-only choice).

    .venv/bin/python bench/kv_memory/host_tier.py [--pool-tokens 2048] [--docs 12] [--requests 48]

The engine alone (LLMEngine, the default model, bfloat16 KV, shedding off), one request at a
time: `--docs` documents of pool/4 tokens each (so 3x the pool at 12), each request one document
and a short question after it, documents in a seeded random order, 1 output token (the prompt is
what the cache serves). Prints per configuration the prefix hit rate (prompt tokens served from
cache / prompt tokens), the host tier's onloaded blocks and the run's seconds:
    pool P, no tier      what an evicted prefix costs today
    pool P + tier 3P     the tier (kv_host_cache_memory = 3x the pool's bytes)
    pool 4P, no tier     the same bytes as the pool's own (on a CPU both are host memory)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inferd.client.bench_workload import WORDS  # noqa: E402
from inferd.engine.builder import load_model  # noqa: E402
from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.engine.worker.kv_cache import bytes_per_block  # noqa: E402
from inferd.settings.policy import SchedulingPolicy, ShedConfig  # noqa: E402
from inferd.text.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16


def documents(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` distinct word salads of exactly `tokens` tokens each."""
    docs = []
    for d in range(count):
        rng = random.Random(d)
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(64)))
        docs.append(ids[:tokens])
    return docs


def run(model, tokenizer, pool_bytes: int, tier_bytes: int, prompts: list[list[int]]) -> dict[str, float]:
    policy = SchedulingPolicy(shedding=ShedConfig(enabled=False))
    engine = LLMEngine(model, tokenizer, EngineConfig.of(policy=policy, kv_cache_memory=pool_bytes,
                                                         kv_host_cache_memory=tier_bytes, speculative="off"))
    params = SamplingParams(max_tokens=1, temperature=0)
    start = time.perf_counter()
    for prompt in prompts:
        engine.generate([prompt], params)
    seconds = time.perf_counter() - start
    bm = engine.block_manager
    tiers = bm.tiers.snapshot()
    return {"hit_rate": bm.prefix_hits / bm.prefix_queries, "host_tokens": tiers.host_hit_tokens,
            "onloaded": tiers.onloaded_blocks, "seconds": seconds, "blocks": bm.pool.num_blocks,
            "tier_blocks": tiers.host_blocks_total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-tokens", type=int, default=2048)
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args()
    model, tokenizer = load_model(EngineConfig.of(dtype="bfloat16"))
    per_block = bytes_per_block(model.cfg, BLOCK, model.dtype)
    pool = (args.pool_tokens // BLOCK) * per_block
    docs = documents(tokenizer, args.docs, args.pool_tokens // 4)
    rng = random.Random(0)
    prompts = [docs[rng.randrange(len(docs))] + tokenizer.encode(f" Question {i}: what is it about?")
               for i in range(args.requests)]
    working_set = sum(len(d) for d in docs)
    print(f"pool {args.pool_tokens} tokens ({pool / 2**20:.1f} MiB), {args.docs} documents of {len(docs[0])} tokens: "
          f"working set {working_set / args.pool_tokens:.1f}x the pool; {args.requests} requests")
    results = {
        "pool P, no tier": run(model, tokenizer, pool, 0, prompts),
        "pool P + tier 3P": run(model, tokenizer, pool, 3 * pool, prompts),
        "pool 4P, no tier": run(model, tokenizer, 4 * pool, 0, prompts),
    }
    base = results["pool P, no tier"]["hit_rate"]
    print("| configuration | KV blocks | tier blocks | prefix hit rate | vs no tier | host-tier tokens | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = f"{r['hit_rate'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['blocks']} | {r['tier_blocks']} | {r['hit_rate']:.1%} | {ratio} | {r['host_tokens']} "
              f"| {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
