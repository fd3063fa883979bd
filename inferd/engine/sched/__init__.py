"""The scheduler: which requests run this step, and how many tokens each.

    scheduler.py   one `schedule()` a step: timeouts, shedding, decodes, prefills, preemption
    request.py     `Request`: one choice's state, written by the scheduler alone
    plan.py        `SchedulerOutput`: ids, block ids and token counts for the runner
    accounting.py  per-class counters and latency samples, and their snapshots
    deadlines.py, fairness.py, shedding.py   order and hard deadlines; VTC fair share; the load shedder

Pure and synchronous, an injected clock: no torch, no tensors (a contract). Imports kv/ (the
block manager it calls), the seam's types and the settings.
"""
