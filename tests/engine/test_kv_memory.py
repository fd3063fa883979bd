"""KV memory for agent sessions on the real default model (issue 43): a prefix evicted to the host
tier comes back with the same output, a session's prefix outlives anonymous traffic of 3x the pool,
and each request says where its cached tokens came from and why it missed."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.protocol import EngineOutput, EngineRequest, Session
from inferd.engine.worker.kv_cache import bytes_per_block
from inferd.settings.policy import SchedulingPolicy, ShedConfig
from inferd.text.sampling_params import SamplingParams

POOL_BLOCKS = 16  # 256 tokens: a small pool that a few prompts fill
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
_groups = itertools.count(1)


def build(weights: tuple, tier_blocks: int = 0) -> LLMEngine:
    model = weights[0]
    per_block = bytes_per_block(model.cfg, 16, model.dtype)
    config = EngineConfig.of(policy=SchedulingPolicy(shedding=ShedConfig(enabled=False)), speculative="off",
                             kv_cache_memory=POOL_BLOCKS * per_block, kv_host_cache_memory=tier_blocks * per_block)
    return LLMEngine(*weights, config)


def run(engine: LLMEngine, prompt: list[int], session: Session | None = None) -> EngineOutput:
    """One request to its end: its last output (tokens of every step merged, and its metrics)."""
    group = next(_groups)
    engine.add_request(EngineRequest(group, prompt, GREEDY, engine.policy.default_class, session=session))
    tokens: list[int] = []
    while engine.scheduler.has_work():
        for out in engine.step().outputs:
            tokens += out.new_token_ids
            if out.finished:
                out.new_token_ids = tokens
                last = out
    engine.block_manager.check_invariants()
    return last


def words(engine: LLMEngine, seed: int, tokens: int) -> list[int]:
    text = " ".join(f"w{(seed * 7919 + i * 104729) % 5003}" for i in range(tokens))
    return engine.tokenizer.encode(text)[:tokens]


@pytest.fixture(scope="module")
def weights(served_weights: tuple) -> tuple:
    return served_weights


def test_an_evicted_prefix_comes_back_from_the_host_tier_unchanged(weights: tuple) -> None:
    engine = build(weights, tier_blocks=64)
    prompt = words(engine, 1, 100)
    first = run(engine, prompt)
    for seed in range(2, 6):  # 4 x 100 tokens through a 256-token pool: the prompt is evicted
        run(engine, words(engine, seed, 100))
    again = run(engine, prompt)
    assert again.metrics.host_cached_tokens == again.metrics.cached_tokens == 96
    assert again.new_token_ids == first.new_token_ids
    assert engine.block_manager.tiers.snapshot().onloaded_blocks == 6
    assert engine.block_manager.num_used_blocks == 0


def test_a_sessions_prefix_outlives_three_pools_of_anonymous_traffic(weights: tuple) -> None:
    engine = build(weights)
    for session in (Session("\0conversation", ttl=300), None):
        convo = words(engine, 11 if session else 12, 120)
        first = run(engine, convo, session)
        for seed in range(20, 26):  # 6 x 130 tokens: 3x the pool
            run(engine, words(engine, seed, 130))
        turn = convo + first.new_token_ids + words(engine, 13, 10)
        second = run(engine, turn, session)
        if session is not None:
            assert second.metrics.cached_tokens >= 0.8 * len(convo)
            assert second.metrics.cache_miss is None  # all of its previous state came back
        else:
            assert second.metrics.cached_tokens == 0 and second.metrics.cache_miss == "evicted"
    assert engine.block_manager.num_used_blocks == 0


def test_each_request_says_why_it_missed(weights: tuple) -> None:
    engine = build(weights)
    prompt = words(engine, 40, 40)
    assert run(engine, prompt).metrics.cache_miss == "cold"
    hit = run(engine, prompt).metrics
    assert (hit.cached_tokens, hit.cache_miss) == (32, None)
    assert run(engine, prompt[:20] + words(engine, 41, 20)).metrics.cache_miss == "diverged within tokens 16-31"


def test_release_and_restore_the_kv_cache_keeps_the_weights_and_the_answers(served_weights: tuple) -> None:
    """Sleep, level 1 (api/routing/lifecycle.py): the KV cache's memory goes at once, the weights
    stay; restored, the engine answers as before, from an empty cache and a whole pool."""
    engine = build(served_weights, tier_blocks=4)
    prompt = words(engine, 1, 40)
    before = run(engine, prompt).new_token_ids
    storage, weights = weakref.ref(engine.kv_cache.storage), engine.model
    per_block = engine.kv_cache.bytes_per_block
    freed = engine.release_kv()
    assert freed == (POOL_BLOCKS + 4) * per_block  # (the device pool and the host tier's 4 blocks)
    assert storage() is None and not hasattr(engine, "kv_cache") and engine.model is weights
    engine.restore_kv()
    assert engine.block_manager.num_cached_blocks == 0 and engine.model is weights
    assert run(engine, prompt).new_token_ids == before
    assert engine.block_manager.num_used_blocks == 0


def test_a_dropped_engines_weights_and_kv_cache_go_without_a_collection() -> None:
    """An unload, or a sleep at level 2 (api/routing/lifecycle.py), drops the engine: its weights
    and KV cache must go with the last reference, the cyclic collector off (a cycle through a
    layer, e.g. its MLP closing over it, kept ~0.5 GB until a full collection, at its own time)."""
    engine = LLMEngine.from_config(EngineConfig.of(kv_cache_memory=8 * 2**20))  # (its own weights: they go)
    parts = [p for layer in engine.model.layers for p in vars(layer).values()]
    tensors = [weakref.ref(t) for p in parts for t in [p, *getattr(p, "__dict__", {}).values()]
               if isinstance(t, torch.Tensor)] + [weakref.ref(engine.model.embed), weakref.ref(engine.kv_cache.storage)]
    layers = [weakref.ref(layer) for layer in engine.model.layers]
    del parts
    assert len(tensors) >= 2 * len(layers)
    gc.disable()
    try:
        del engine
        assert all(ref() is None for ref in layers) and all(ref() is None for ref in tensors)
    finally:
        gc.enable()
