"""Scheduler cost per step: `schedule()` + `update()` (and the block manager calls they make).

No model and no torch: N requests with prompts of 100..1000 tokens (block size 16, blocks for
all) are prefilled, then every step decodes one token for each of the N running requests with a
fabricated sampled token. Each step's time excludes only building the fabricated `sampled` dict
(the engine builds that from the sampler's output, not the scheduler). Prints the median and
p90 per step over --steps steps, for each N; the issue's target is < 1 ms at N = 256.

    python bench/scheduler_step.py [--running 64,256,1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.sched.request import Request
from inferd.engine.sched.scheduler import Scheduler
from inferd.text.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_scheduler(num_running: int, steps: int, seed: int = 0) -> Scheduler:
    """A scheduler whose `num_running` requests are all past prefill and decoding."""
    rng = random.Random(seed)
    lengths = [rng.randint(100, 1000) for _ in range(num_running)]
    max_len = 1000 + steps + 8
    num_blocks = sum(-(-(n + steps + 1) // BLOCK_SIZE) for n in lengths) + 16
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    # a budget big enough to prefill everything in one step; decode steps use N tokens of it
    scheduler = Scheduler(bm, max_num_seqs=num_running, max_num_batched_tokens=sum(lengths))
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    cls = scheduler.policy.lookup(None)  # the default class
    for i, n in enumerate(lengths):
        scheduler.add(Request(i, [rng.randrange(1, 49152) for _ in range(n)], params, max_len, priority_class=cls))
    plan = scheduler.schedule()
    assert len(plan.prefills) == num_running and not scheduler.waiting
    scheduler.update(plan, {c.request.seq_id: 42 for c in plan.chunks})
    return scheduler


def bench(num_running: int, steps: int) -> list[float]:
    """Seconds per step (schedule + update) for `steps` decode steps of `num_running` requests."""
    scheduler = make_scheduler(num_running, steps)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        sampled = {c.request.seq_id: 100 + step for c in plan.decodes}
        t2 = time.perf_counter()
        scheduler.update(plan, sampled)
        t3 = time.perf_counter()
        assert len(plan.decodes) == num_running and not plan.prefills and not plan.preempted
        times.append((t1 - t0) + (t3 - t2))
    scheduler.block_manager.check_invariants()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="64,256,1024", help="comma-separated running counts")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"block size {BLOCK_SIZE}, prompts of 100..1000 tokens, {args.steps} decode steps each\n")
    print("| running | median ms/step | p90 ms/step | us/seq |")
    print("|---:|---:|---:|---:|")
    for n in [int(x) for x in args.running.split(",")]:
        times = sorted(bench(n, args.steps))
        median, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
        print(f"| {n} | {median * 1e3:.3f} | {p90 * 1e3:.3f} | {median / n * 1e6:.2f} |", flush=True)


if __name__ == "__main__":
    main()
