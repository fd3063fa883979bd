"""Pooling requests in the engine (embeddings and scores): prefill-only, pooled from the final
hidden states as transformers computes them, equal alone, chunked and batched with generation,
and every block returned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiny_models as tm
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.protocol import EngineOutput, EngineRequest, PoolingParams
from inferd.text.sampling_params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("pooling")
    vocab = tm.train_sentencepiece(folder)
    model = tm.randomize(tm.tiny_llama(vocab), seed=0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model.eval()


def engine_for(folder: Path, **keys: object) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=16 * 2**20,
                                                 **keys))


def run(engine: LLMEngine, prompts: list[list[int]], pooling: PoolingParams | None,
        generate: list[list[int]] = ()) -> tuple[list[EngineOutput], dict[int, list[int]]]:
    """Every prompt as a pooling request, and `generate`'s as greedy generations, in one run:
    the pooling requests' final outputs in order, and each generation's tokens."""
    cls = engine.policy.lookup(None).name
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(i, ids, ONE, cls, pooling=pooling))
    for j, ids in enumerate(generate):
        engine.add_request(EngineRequest(1000 + j, ids, GREEDY, cls))
    finals: dict[int, EngineOutput] = {}
    tokens: dict[int, list[int]] = {1000 + j: [] for j in range(len(generate))}
    while engine.has_work():
        for out in engine.step().outputs:
            if out.group_id >= 1000:
                tokens[out.group_id] += out.new_token_ids
            elif out.finished:
                finals[out.group_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    return [finals[i] for i in range(len(prompts))], tokens


def reference(model: object, prompts: list[list[int]], method: str) -> torch.Tensor:
    """transformers' last_hidden_state pooled, normalized."""
    vectors = []
    with torch.inference_mode():
        for ids in prompts:
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, H]
            vectors.append({"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[method])
    return torch.nn.functional.normalize(torch.stack(vectors), dim=-1)


@pytest.fixture(scope="module")
def prompts(checkpoint: tuple[Path, object]) -> list[list[int]]:
    engine = engine_for(checkpoint[0])
    return [engine.tokenizer.encode(p) for p in tm.PROMPTS]


@pytest.mark.parametrize("method", ["mean", "last", "cls"])
def test_embeddings_equal_transformers_pooled_hidden_states_alone_chunked_and_beside_generation(
        checkpoint: tuple[Path, object], prompts: list[list[int]], method: str) -> None:
    folder, model = checkpoint
    expected = reference(model, prompts, method)
    engine = engine_for(folder, pooling=method)
    assert engine.limits.pooler is not None and engine.limits.pooler.method == method
    alone = [run(engine, [p], PoolingParams())[0][0] for p in prompts]
    for out, want in zip(alone, expected):
        assert out.finished and out.finish_reason == "stop" and out.new_token_ids == []
        assert torch.allclose(torch.tensor(out.pooled), want, atol=1e-5)
    # all at once, beside generations, in chunks of 5 tokens: the same vectors, the same tokens
    solo = [run(engine, [], None, [p])[1][1000] for p in prompts[:2]]
    chunked = engine_for(folder, pooling=method, max_num_batched_tokens=5)
    together, tokens = run(chunked, prompts, PoolingParams(), prompts[:2])
    assert [tokens[1000], tokens[1001]] == solo
    for out, want in zip(together, expected):
        assert torch.allclose(torch.tensor(out.pooled), want, atol=1e-5)


def test_a_score_is_the_yes_logit_minus_the_no_logit_and_a_cached_prefix_is_reused(
        checkpoint: tuple[Path, object], prompts: list[list[int]]) -> None:
    folder, model = checkpoint
    no, yes = 5, 7
    engine = engine_for(folder, task="score")
    assert engine.limits.task == "score" and engine.limits.pooler is None
    shared = prompts[0] * 3  # (several blocks: the second request finds them cached)
    asked = [shared + prompts[1], shared + prompts[2]]
    outs = [run(engine, [p], PoolingParams("score", (no, yes)))[0][0] for p in asked]
    with torch.inference_mode():
        for out, ids in zip(outs, asked):
            logits = model(torch.tensor([ids])).logits[0, -1]
            assert out.score == pytest.approx(float(logits[yes] - logits[no]), abs=1e-4)
    assert outs[1].metrics is not None and outs[1].metrics.cached_tokens >= engine.limits.block_size


def test_a_generate_model_with_embeddings_off_has_no_pooler(checkpoint: tuple[Path, object]) -> None:
    assert engine_for(checkpoint[0], embeddings=False).limits.pooler is None
