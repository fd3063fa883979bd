"""Linear attention's decode step on the CPU: our kernels (conv_step + delta_step, through the
face) against the torch reference, at batch 1 and 32, for a Qwen3.5-4B-shaped Gated DeltaNet layer
(16 key heads, 32 value heads, heads of 128, conv width 4, bfloat16); and one prefill chunk, which
both run on the reference's chunked torch.

    .venv/bin/python bench/kernels/linear_attention.py [--batches 1,32] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from inferd.kernels import ops
from inferd.kernels.linear_attention import StatePlan

HK, HV, DK, DV, K, DTYPE = 16, 32, 128, 128, 4, torch.bfloat16
CPU = torch.device("cpu")


def median_us(run: Callable[[], object], repeats: int = 30) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def step(lens: list[int], num_decode: int) -> tuple[StatePlan, tuple, tuple]:
    n, T, C = len(lens), sum(lens), 2 * HK * DK + HV * DV
    plan = StatePlan.build(lens, list(range(n)), [num_decode == 0] * n, [], num_decode, CPU)
    conv = (torch.randn(T, C, dtype=DTYPE), torch.randn(C, K, dtype=DTYPE), torch.randn(n, K - 1, C, dtype=DTYPE))
    delta = (torch.randn(T, HK, DK, dtype=DTYPE), torch.randn(T, HK, DK, dtype=DTYPE), torch.randn(T, HV, DV, dtype=DTYPE),
             -torch.rand(T, HV), torch.rand(T, HV), torch.randn(n, HV, DK, DV) * 0.1)
    return plan, conv, delta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels, reference = ops.linear_attention_ops(CPU, DTYPE), ops.reference_linear_attention()
    print(f"Gated DeltaNet layer Hk={HK} Hv={HV} dk=dv={DK} conv {K} bfloat16, {args.threads} threads; "
          f"backend: {kernels.backend}")
    print(f"{'step':>16} {'op':>6} {'kernel µs':>10} {'reference µs':>13} {'speed-up':>9}")
    cases = [(f"decode x {b}", [1] * b, b) for b in map(int, args.batches.split(","))] + [("prefill 1 x 256", [256], 0)]
    for label, lens, num_decode in cases:
        plan, conv, delta = step(lens, num_decode)
        for name, call in (("conv", lambda bound, c=conv, p=plan: bound.conv(*c, p)),
                           ("delta", lambda bound, d=delta, p=plan: bound.delta(*d, p))):
            ours = median_us(lambda c=call: c(kernels))
            theirs = median_us(lambda c=call: c(reference), repeats=10)
            print(f"{label:>16} {name:>6} {ours:10.0f} {theirs:13.0f} {theirs / ours:8.1f}x")


if __name__ == "__main__":
    main()
