"""Prefill attention alone, the default model's shapes (9 query heads over 3 KV heads, head size
64, bfloat16, blocks of 16): our CPU kernel over the paged cache in place
(inferd/kernels/cpu/csrc/cpu_prefill_attention.cpp) against the reference it replaced, the
context gathered and torch's SDPA (inferd.kernels.reference.attention_planned), in one run.

    python bench/kernels/prefill_attention.py [--shapes 512:512,1500:500,6000:512,6000:2048] [--seconds 1]

One line per CONTEXT:CHUNK (a chunk's rows, the last of its context): each side's ms per call
(the mean over --seconds of calls), the kernel's GFLOP/s and the ratio SDPA / kernel.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from inferd.kernels import cpu, reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def mean_ms(call: Callable[[], object], seconds: float) -> float:
    call()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        call()
        n += 1
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="512:512,1500:500,6000:512,6000:2048")
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    assert cpu.prefill_attention_available(), "the prefill kernel needs AVX512-BF16 and the kernels built"
    for shape in args.shapes.split(","):
        context, chunk = (int(n) for n in shape.split(":"))
        blocks = -(-context // BLOCK)
        key_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        value_cache = torch.randn_like(key_cache)
        table = torch.randperm(blocks)[None].int()
        query = torch.randn(chunk, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        lens, query_lens = torch.tensor([context]), torch.tensor([chunk])
        plan = reference.plan_attention(table.long(), lens, query_lens, BLOCK, max_seq_len=context,
                                        max_query_len=chunk, num_query_tokens=chunk, kv_block=reference.KV_BLOCK)
        starts = torch.tensor([0, chunk], dtype=torch.int32)
        sdpa = mean_ms(lambda: reference.attention_planned(query, key_cache, value_cache, plan, 0.125), args.seconds)
        kernel = mean_ms(lambda: cpu.prefill_attention(query, key_cache, value_cache, table, lens.int(), starts, 0.125),
                         args.seconds)
        flops = 4 * HEADS * HEAD_DIM * chunk * (context - chunk / 2)
        print(f"context {context}, chunk {chunk}: gather + SDPA {sdpa:.2f} ms, kernel {kernel:.2f} ms "
              f"({flops / kernel / 1e6:.0f} GFLOP/s): {sdpa / kernel:.2f}x", flush=True)


if __name__ == "__main__":
    main()
