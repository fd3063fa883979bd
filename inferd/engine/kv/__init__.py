"""KV memory as block ids: which blocks each request holds, which are free, which are cached.

    block_manager.py  allocate, append, free, swap; the check-then-act calls the scheduler makes
    groups.py         KV groups: which layers share a block table; what a sliding window keeps
    host.py           host blocks of swapped-out sequences
    block_pool.py     the free list and reference counts
    prefix_cache.py   full blocks by the hash of their tokens, for reuse across requests
    events.py         ([kv_events] on) what the prefix cache filed and dropped, for cache-aware routers

No tensors (a contract): the tensors themselves are worker/kv_cache.py's.
"""
