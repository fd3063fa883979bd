"""Prompt logprobs (what /v1/completions' echo reports, lm-evaluation-harness's loglikelihood):
every prompt token after the first, scored by the prefill, against transformers' float32
log-softmax at each position, in one chunk or many, with the prompt's prefix already cached."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import tiny_models as tm  # noqa: E402 - after the skips

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.text.sampling_params import SamplingParams  # noqa: E402

TOP = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, list[list[int]]]:
    folder = tmp_path_factory.mktemp("llama")
    model = tm.tiny_llama(tm.train_sentencepiece(folder))
    model.save_pretrained(folder, safe_serialization=True)
    engine = engine_of(folder)
    text = engine.tokenizer.encode(tm.CORPUS, add_special_tokens=False)
    prompts = [engine.tokenizer.encode(p) for p in tm.PROMPTS] + [[1, *text[:70]]]  # one past 4 blocks
    return folder, model, prompts


def engine_of(folder: Path, **overrides: object) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=16 * 2**20,
                                              **overrides))


def reference(model: object, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: transformers' log-softmax at each position but the last."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(engine: LLMEngine, model: object, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP)
    for prompt, completion in zip(prompts, engine.generate(prompts, params)):
        expected = reference(model, prompt)
        got = completion.prompt_logprobs
        assert got is not None and [e.token_id for e in got] == prompt[1:]
        for position, entry in enumerate(got):
            assert abs(entry.logprob - expected[position, prompt[position + 1]].item()) < 1e-4
            top = expected[position].topk(TOP)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert max(abs(lp - e) for (_, lp), e in zip(entry.top, top.values.tolist())) < 1e-4
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def test_prompt_logprobs_match_transformers(tiny) -> None:
    folder, model, prompts = tiny
    check(engine_of(folder), model, prompts)


def test_in_chunks_of_five_tokens_too(tiny) -> None:
    folder, model, prompts = tiny
    check(engine_of(folder, max_num_batched_tokens=5), model, prompts)


def test_a_cached_prefix_is_computed_again_for_them(tiny) -> None:
    folder, model, prompts = tiny
    engine = engine_of(folder)
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))  # the prefixes now cached
    hits = engine.block_manager.prefix_hits
    check(engine, model, prompts)
    assert engine.block_manager.prefix_hits == hits  # none served from the cache
