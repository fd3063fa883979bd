"""What `[model] deterministic` (batch-invariant results on the CPU) costs, against the default,
measured in the same run (issue 16).

    .venv/bin/python bench/kernels/deterministic.py [--batches 1 16 32] [--max-tokens 64] [--rounds 2]

Two engines over the default GGUF in bfloat16, each with its own copy of the weights (the mode
is set on the model): the default one and the deterministic one (every linear with at least two
rows, attention contexts padded to whole 512-key blocks). For each batch size, each engine runs
the same batch of ~32-token prompts to --max-tokens greedy tokens (EOS ignored) with
`LLMEngine.generate`, alternating engines for --rounds rounds; the table shows the median output
tok/s of each and their ratio, and whether every request's tokens were the same in both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.text.sampling_params import SamplingParams

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly vexing brains".split()


def prompts(n: int) -> list[str]:
    return [f"Story {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(24 + i % 16)) for i in range(n)]


def run(engine: LLMEngine, batch: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate(batch, params)
    return len(batch) * max_tokens / (time.perf_counter() - start), [c.token_ids for c in done]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    engines = {mode: LLMEngine.from_config(EngineConfig.of(dtype="bfloat16", kv_cache_memory=512 * 2**20,
                                                        enable_prefix_caching=False, deterministic=mode))
               for mode in (False, True)}
    print("| batch | deterministic off tok/s | on (the default) tok/s | on / off | same tokens |")
    print("|---:|---:|---:|---:|---|")
    for n in args.batches:
        batch = prompts(n)
        rates: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, list[list[int]]] = {}
        run(engines[False], batch[:1], 4), run(engines[True], batch[:1], 4)  # (warm-up)
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                rate, tokens[mode] = run(engine, batch, args.max_tokens)
                rates[mode].append(rate)
        default, det = statistics.median(rates[False]), statistics.median(rates[True])
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        print(f"| {n} | {default:.1f} | {det:.1f} | {det / default:.2f}x | {same} of {n} |", flush=True)


if __name__ == "__main__":
    main()
