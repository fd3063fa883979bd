"""Prefill time of fresh prompts, engine alone, per dtype (a packed model prefills through its
dense copy of each layer, or on AMX tiles where they beat it), and, with --turn, of a turn that
adds tokens to a cached context (prefix caching on; the context prefilled once, untimed).

    python bench/kernels/prefill.py [--tokens 100[,1500,6000]] [--turn 3400,640] [--runs 3] [--dtypes bfloat16,float32]

Prints one line per dtype and size, "prefill DTYPE T: median N ms" ("prefill DTYPE turn C+T:
median N ms"), which bench/ab.py reads with
--metric 'prefill (?P<key>[\\w +]+): median (?P<value>[\\d.]+) ms' --lower-is-better. Each run's
prompt is new (random token ids), so no run hits the cache of another. For two trees, alternate
them on PYTHONPATH (a tree whose copy of this script predates --turn can run this one).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.text.sampling_params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0)
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # the default model's layers x K and V x KV heads x head size x bf16


def engine_for(dtype: str, tokens: int, caching: bool) -> LLMEngine:
    memory = max(64 * 2**20, 2 * tokens * KV_BYTES_PER_TOKEN * (2 if dtype == "float32" else 1))
    return LLMEngine.from_config(EngineConfig.of(dtype=dtype, kv_cache_memory=memory, enable_prefix_caching=caching))


def fresh_ms(engine: LLMEngine, tokens: int, runs: int, rng: random.Random) -> float:
    times = []
    for _ in range(runs):
        prompt = [rng.randrange(100, 40_000) for _ in range(tokens)]
        start = time.perf_counter()
        engine.generate([prompt], ONE)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def turn_ms(engine: LLMEngine, context: int, added: int, runs: int, rng: random.Random) -> float:
    times = []
    for _ in range(runs):
        cached = [rng.randrange(100, 40_000) for _ in range(context)]
        engine.generate([cached], ONE)  # (untimed: the context's blocks are cached after it)
        turn = cached + [rng.randrange(100, 40_000) for _ in range(added)]
        start = time.perf_counter()
        engine.generate([turn], ONE)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="100", help="fresh prompts' sizes, comma-separated")
    parser.add_argument("--turn", default="", help="CONTEXT,ADDED: a turn of ADDED tokens on a cached CONTEXT")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = [int(n) for n in args.tokens.split(",") if n]
    rng = random.Random(args.seed)
    for dtype in args.dtypes.split(","):
        if sizes:
            engine = engine_for(dtype, max(sizes), caching=False)
            fresh_ms(engine, 64, 1, rng)  # warm-up
            for tokens in sizes:
                print(f"prefill {dtype} {tokens}: median {fresh_ms(engine, tokens, args.runs, rng):.1f} ms", flush=True)
            del engine
        if args.turn:
            context, added = (int(n) for n in args.turn.split(","))
            engine = engine_for(dtype, (context + added) * args.runs, caching=True)
            ms = turn_ms(engine, context, added, args.runs, rng)
            print(f"prefill {dtype} turn {context}+{added}: median {ms:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
