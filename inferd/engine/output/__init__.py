"""What a step's tokens become: one `EngineOutput` per choice.

    processor.py  detokenize, stop strings and ids, lengths; the per-choice output hooks
    blocklist.py  the streaming output filter (pyahocorasick): mask, or end with content_filter
    segmenter.py  text released in whole sentences (pysbd) or lines

Imports sched/ (the request's state), the model's detokenizer and the seam's types.
"""
