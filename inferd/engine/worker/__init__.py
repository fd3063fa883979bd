"""The step as tensors: the scheduler's plan in, sampled tokens out.

    runner.py       `ModelRunner`: the plan as tensors, the forward over the paged cache, sampling
    executor.py     runs a step, splits it on out of memory, fails a request alone
    kv_cache.py     the KV cache's tensors (device and host), sized from memory
    cuda_graphs.py  decode steps captured as CUDA graphs
    faults.py       fault injection for tests (INFERD_FAULTS), off unless set

Imports the model, the kernels (through the model), sched/ (the plan's types), structured/
(token masks) and the seam's types.
"""
