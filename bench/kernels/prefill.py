"""Prefill time of one prompt, engine alone, per dtype: the dense rows' products (a packed model
prefills through its dense copy of each layer).

    python bench/kernels/prefill.py [--tokens 100] [--runs 3] [--dtypes bfloat16,float32]

Prints one line per dtype, "prefill DTYPE: median N ms (T tokens)", which bench/ab.py reads with
--metric 'prefill (?P<key>\\w+): median (?P<value>[\\d.]+) ms' --lower-is-better.
"""

from __future__ import annotations

import argparse
import statistics
import time

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.text.sampling_params import SamplingParams

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards".split()


def prefill_ms(dtype: str, tokens: int, runs: int) -> tuple[float, int]:
    engine = LLMEngine.from_config(EngineConfig.of(dtype=dtype, kv_cache_memory=64 * 2**20, enable_prefix_caching=False))
    ids = engine.tokenizer.encode(" ".join(WORDS[i % len(WORDS)] for i in range(tokens)))[:tokens]
    one = SamplingParams(max_tokens=1, temperature=0)
    engine.generate([ids], one)  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        engine.generate([ids], one)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    for dtype in args.dtypes.split(","):
        ms, tokens = prefill_ms(dtype, args.tokens, args.runs)
        print(f"prefill {dtype}: median {ms:.1f} ms ({tokens} tokens)", flush=True)


if __name__ == "__main__":
    main()
