"""What the gateway adds to a request (issue 13): its admission cost with 1,000 tenants configured.

    .venv/bin/python bench/gateway.py            # ~20 s

1. The gateway's work per request, in-process, the same calls in the same order as a request
   makes them: the key's lookup (SHA-256, then the digest index and a constant-time compare),
   the model and class permissions, the dual bucket charge, the x-ratelimit-* headers, and at
   the end the refund. Each tenant has two keys and both limits; requests cycle through every
   tenant's keys. Measured with 1,000 tenants and, in the same run, with 1 (the peer: what a
   larger keyring costs). Median of --repeats runs of --requests requests each.
2. The scheduler's side: one `schedule()` call admitting into a batch from a waiting queue of
   1,000 tenants' requests (one each), under "vtc" against "fcfs", per admitted request.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from itertools import cycle

from inferd.api.gateway.gate import Gateway
from inferd.api.gateway.tenants import Keyring
from inferd.settings.config import Settings
from inferd.engine.kv.block_manager import BlockManager
from inferd.settings.policy import SchedulingPolicy
from inferd.engine.sched.request import Request
from inferd.engine.sched.scheduler import Scheduler
from inferd.text.sampling_params import SamplingParams


def tenants_settings(n: int) -> tuple[Settings, list[str]]:
    keys, tenants = [], {}
    for i in range(n):
        mine = [f"sk-tenant-{i}-{k}" for k in range(2)]
        keys += mine
        tenants[f"t{i}"] = {"key_sha256": [hashlib.sha256(k.encode()).hexdigest() for k in mine],
                            "requests_per_second": 1e9, "tokens_per_second": 1e12, "tokens_burst": 10**9,
                            "classes": ["interactive", "batch"], "models": ["smollm2"], "tier": "paid"}
    return Settings.model_validate({"tenants": tenants}), keys


def gateway_cost(n: int, requests: int) -> float:
    """Seconds per request of the gateway's calls with `n` tenants configured."""
    settings, keys = tenants_settings(n)
    gateway = Gateway(Keyring.build(settings), settings.policy())
    keyring = gateway.keyring
    order = cycle(keys)
    start = time.perf_counter()
    for _ in range(requests):
        principal = keyring.lookup(next(order))
        assert principal is not None
        gateway.authorize(principal, "smollm2", "interactive")
        ticket = gateway.charge(principal, 300)
        gateway.headers(principal)
        assert ticket is not None
        ticket.close(40, 60)
    return (time.perf_counter() - start) / requests


def schedule_cost(fairness: str, tenants: int, max_num_seqs: int) -> float:
    """Seconds per admitted request of one schedule() over `tenants` waiting requests."""
    scheduler = Scheduler(BlockManager(max_num_seqs * 8 + 8, 16), max_num_seqs, max_num_batched_tokens=max_num_seqs * 64,
                          policy=SchedulingPolicy(fairness=fairness))
    params = SamplingParams(max_tokens=16)
    for i in range(tenants):
        request = Request(i, list(range(1, 33)), params, max_model_len=2048,
                          priority_class=scheduler.policy.lookup(None))
        request.tenant, request.tenant_weight = f"t{i}", 1.0 + i % 3
        scheduler.add(request)
    start = time.perf_counter()
    out = scheduler.schedule()
    seconds = time.perf_counter() - start
    return seconds / max(1, len(out.started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("1. gateway per request (lookup, permissions, dual bucket charge, headers, refund)")
    costs: dict[int, list[float]] = {1000: [], 1: []}
    for _ in range(args.repeats):  # interleaved, so both sides see the same machine
        for n in costs:
            costs[n].append(gateway_cost(n, args.requests))
    big, one = (statistics.median(costs[n]) for n in (1000, 1))
    print(f"   1,000 tenants: {big * 1e6:.2f} us   1 tenant: {one * 1e6:.2f} us   ratio {big / one:.2f}x")
    print("2. one schedule() over 1,000 waiting tenants' requests, per admitted request (max_num_seqs 64)")
    for fairness in ("fcfs", "vtc"):
        cost = statistics.median(schedule_cost(fairness, 1000, 64) for _ in range(args.repeats))
        print(f"   {fairness}: {cost * 1e6:.1f} us")


if __name__ == "__main__":
    main()
