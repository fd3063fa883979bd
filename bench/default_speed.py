"""The default model's offline generation speed on the served path (bf16, packed weights):
one engine, a ~60-token prompt, batch 1 x 96 tokens and batch 16 x 64 tokens, each after a
4-token warm-up. For A/B runs of two trees, alternate them on PYTHONPATH:

    PYTHONPATH=TREE .venv/bin/python bench/default_speed.py
"""

from __future__ import annotations

import time

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.model.loading.loader import default_model_path
from inferd.text.sampling_params import SamplingParams

TEXT = "The history of computing is a story of ideas that moved from laboratories into everyday life. " * 3


def main() -> None:
    engine = LLMEngine.from_config(EngineConfig.of(model=str(default_model_path())))
    prompt = engine.tokenizer.encode(TEXT)
    for batch, tokens in ((1, 96), (16, 64)):
        engine.generate([prompt] * batch, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        start = time.perf_counter()
        engine.generate([prompt] * batch, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        print(f"batch {batch}: {batch * tokens / (time.perf_counter() - start):.1f} tok/s")


if __name__ == "__main__":
    main()
