"""Speculative decoding without a draft model: which tokens a request drafts, and when.

    drafters.py     the indexes drafts are read from: a request's own tokens (suffix, n-gram) and,
                    opted in, its tenant's recent outputs
    speculator.py   per step: whose drafts, how many, and whether to draft at all ("auto")

Pure and synchronous, no tensors (a contract). The runner verifies the drafts
(engine/worker/speculation.py); the scheduler makes room for them and gives back what the
rejected ones took (Scheduler.update, BlockManager.truncate).
"""
