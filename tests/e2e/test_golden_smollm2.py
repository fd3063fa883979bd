"""Golden test: greedy tokens of the default SmolLM2 GGUF, token for token against transformers.

transformers dequantizes the same GGUF to float32; inferd runs float32 over its paged cache.
Each prompt runs alone and then all together in one ragged batch (prefills of different
lengths in one step, then decodes of different lengths).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.model.loading.loader import default_model_path
from inferd.text.sampling_params import SamplingParams

NEW_TOKENS = 32
PROMPTS = [
    "The history of the Roman Empire begins",
    "def quicksort(arr):\n    ",
    "Übersetze ins Englische: Der Hund schläft unter dem Tisch, weil es draußen regnet. 日本語も少し。",
    "CHAT:Write a short poem about the sea.",
    "CHAT:Explain in two sentences why the sky is blue.",
]


def prompt_ids(engine: LLMEngine, prompt: str) -> list[int]:
    tokenizer = engine.tokenizer
    if prompt.startswith("CHAT:"):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt[5:]}])
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


@pytest.fixture(scope="module")
def engine(float32_weights: tuple) -> LLMEngine:
    return LLMEngine(*float32_weights, EngineConfig.of(dtype="float32", kv_cache_memory=256 * 2**20))


@pytest.fixture(scope="module")
def reference_tokens(engine: LLMEngine, transformers_gguf: Any) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    model = transformers_gguf(transformers.AutoModelForCausalLM, default_model_path(), dtype=torch.float32)
    expected = []
    for prompt in PROMPTS:
        ids = prompt_ids(engine, prompt)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=sorted(engine.tokenizer.eos_token_ids),
                pad_token_id=engine.tokenizer.pad_token_id,
            )
        expected.append(out[0, len(ids):].tolist())
    return expected


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)


def test_reference_is_long_enough(reference_tokens: list[list[int]]) -> None:
    # guards the comparison below from passing on trivially short outputs
    assert sum(len(t) for t in reference_tokens) >= NEW_TOKENS * (len(PROMPTS) - 1)


# one prompt alone in the default tier (the ragged batch below checks all five against the same
# reference); each of them alone in the soak tier
@pytest.mark.parametrize("index", [0, *(pytest.param(i, marks=pytest.mark.soak) for i in range(1, len(PROMPTS)))])
def test_greedy_alone_matches_transformers(engine: LLMEngine, reference_tokens: list[list[int]], index: int) -> None:
    [completion] = engine.generate([prompt_ids(engine, PROMPTS[index])], GREEDY)
    assert completion.token_ids == reference_tokens[index]
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_greedy_ragged_batch_matches_transformers(engine: LLMEngine, reference_tokens: list[list[int]]) -> None:
    completions = engine.generate([prompt_ids(engine, p) for p in PROMPTS], GREEDY)
    assert [c.token_ids for c in completions] == reference_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_chunked_prefill_matches_transformers(reference_tokens: list[list[int]], float32_weights: tuple) -> None:
    # a 16-token step budget splits every prompt into chunks that continue a cached prefix
    small = LLMEngine(*float32_weights, EngineConfig.of(dtype="float32", kv_cache_memory=64 * 2**20,
                                                     max_num_batched_tokens=16, block_size=4))
    completions = small.generate([prompt_ids(small, p) for p in PROMPTS], GREEDY)
    assert [c.token_ids for c in completions] == reference_tokens
    assert small.block_manager.num_free_blocks == small.block_manager.pool.num_blocks
