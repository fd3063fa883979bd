"""Golden test: greedy tokens of the default SmolLM2 GGUF, token for token against transformers.

transformers dequantizes the same GGUF to float32; inferd runs float32 over its paged cache.
Each prompt runs alone and then all together in one ragged batch (prefills of different
lengths in one step, then decodes of different lengths). The soak tier compares 32 new tokens a
prompt; the default tier's twins the same prompts' first 16 (the reference's generation, and
each engine's, is most of the time here).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.model.loading.loader import default_model_path
from inferd.text.sampling_params import SamplingParams

NEW_TOKENS = 32  # the soak tier's continuations
SHORT_TOKENS = 16  # the default tier's
LENGTHS = [pytest.param(NEW_TOKENS, marks=pytest.mark.soak, id=str(NEW_TOKENS)), SHORT_TOKENS]
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
def reference_model(transformers_gguf: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers_gguf(transformers.AutoModelForCausalLM, default_model_path(), dtype=torch.float32)


@pytest.fixture(scope="module")
def references() -> dict[int, list[list[int]]]:
    """The references made so far in this module, by length."""
    return {}


@pytest.fixture
def reference_tokens(engine: LLMEngine, reference_model: Any, references: dict[int, list[list[int]]],
                     new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, `new_tokens` long (shorter at an EOS)."""
    if new_tokens not in references:
        expected = []
        for prompt in PROMPTS:
            ids = prompt_ids(engine, prompt)
            with torch.inference_mode():
                out = reference_model.generate(
                    torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=new_tokens, do_sample=False, eos_token_id=sorted(engine.tokenizer.eos_token_ids),
                    pad_token_id=engine.tokenizer.pad_token_id,
                )
            expected.append(out[0, len(ids):].tolist())
        references[new_tokens] = expected
    return references[new_tokens]


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0)


@pytest.mark.parametrize("new_tokens", LENGTHS)
def test_reference_is_long_enough(reference_tokens: list[list[int]], new_tokens: int) -> None:
    # guards the comparison below from passing on trivially short outputs
    assert sum(len(t) for t in reference_tokens) >= new_tokens * (len(PROMPTS) - 1)


# one prompt alone in the default tier (the ragged batch below checks all five against the same
# reference); each of them alone in the soak tier
@pytest.mark.parametrize(("new_tokens", "index"), [
    (SHORT_TOKENS, 0), *(pytest.param(NEW_TOKENS, i, marks=pytest.mark.soak) for i in range(len(PROMPTS)))])
def test_greedy_alone_matches_transformers(engine: LLMEngine, reference_tokens: list[list[int]], new_tokens: int,
                                           index: int) -> None:
    [completion] = engine.generate([prompt_ids(engine, PROMPTS[index])], greedy(new_tokens))
    assert completion.token_ids == reference_tokens[index]
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


@pytest.mark.parametrize("new_tokens", LENGTHS)
def test_greedy_ragged_batch_matches_transformers(engine: LLMEngine, reference_tokens: list[list[int]],
                                                  new_tokens: int) -> None:
    completions = engine.generate([prompt_ids(engine, p) for p in PROMPTS], greedy(new_tokens))
    assert [c.token_ids for c in completions] == reference_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


@pytest.mark.parametrize("new_tokens", LENGTHS)
def test_chunked_prefill_matches_transformers(reference_tokens: list[list[int]], float32_weights: tuple,
                                              new_tokens: int) -> None:
    # a 16-token step budget splits every prompt into chunks that continue a cached prefix
    small = LLMEngine(*float32_weights, EngineConfig.of(dtype="float32", kv_cache_memory=64 * 2**20,
                                                     max_num_batched_tokens=16, block_size=4))
    completions = small.generate([prompt_ids(small, p) for p in PROMPTS], greedy(new_tokens))
    assert [c.token_ids for c in completions] == reference_tokens
    assert small.block_manager.num_free_blocks == small.block_manager.pool.num_blocks
