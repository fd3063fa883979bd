"""Speculative decoding's benchmarks (issue 42).

    served.py     the acceptance measurements against `--speculative off` and the peers, served
    crossover.py  the engine alone: where speculation stops paying (auto's max_batch)
    copying.py    served.py's copy-heavy completions
"""
