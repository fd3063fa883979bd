"""Packed weights (`[model] weights`, inferd/model/layers/quant.py) against dense bf16 ones, measured in
the same run (issue 16).

    .venv/bin/python bench/kernels/packed.py [--batches 1 4 16 32] [--max-tokens 64] [--rounds 2]

Two engines over the default GGUF in bfloat16, otherwise in the default configuration: weights
"bf16" (every layer dequantized at load) and "auto" (the default: the Q4_1 layers kept as 4-bit
codes, decode rows on torch's packed int4 product, prefill rows on a dense copy). Same workload
and table as bench/kernels/deterministic.py (the engines alternate; median of --rounds); "same tokens"
compares the two engines' greedy text (not expected to match: the weights' arithmetic differs).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from deterministic import prompts, run

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    engines = {mode: LLMEngine.from_config(EngineConfig.of(dtype="bfloat16", kv_cache_memory=512 * 2**20,
                                                        enable_prefix_caching=False, weights=mode))
               for mode in ("bf16", "auto")}
    print("| batch | bf16 weights tok/s | packed (auto, the default) tok/s | packed / bf16 |")
    print("|---:|---:|---:|---:|")
    for n in args.batches:
        batch = prompts(n)
        rates: dict[str, list[float]] = {mode: [] for mode in engines}
        for engine in engines.values():
            run(engine, batch[:1], 4)  # (warm-up)
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                rates[mode].append(run(engine, batch, args.max_tokens)[0])
        dense, packed = statistics.median(rates["bf16"]), statistics.median(rates["auto"])
        print(f"| {n} | {dense:.1f} | {packed:.1f} | {packed / dense:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
