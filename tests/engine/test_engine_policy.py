"""The scheduling policy on the real default model: preemption in both modes keeps greedy text
exact, a shared prefix is computed once, timeouts end requests and free their blocks."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.policy import SchedulingPolicy, Timeouts
from inferd.engine.protocol import EngineRequest
from inferd.text.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["Dogs are", "The ocean is deep and", "In 1969, the first", "Python is a language that",
           "My grandmother used to say", "Ten facts about volcanoes:"]


@pytest.fixture(scope="module")
def roomy(float32_weights: tuple) -> LLMEngine:
    return LLMEngine(*float32_weights, EngineConfig.of(dtype="float32", kv_cache_memory=64 * 2**20, block_size=4))


def sibling(engine: LLMEngine, **config: object) -> LLMEngine:
    """Another engine over the same loaded model, with its own cache and policy."""
    return LLMEngine(engine.model, engine.tokenizer, EngineConfig.of(dtype="float32", **config))  # type: ignore[arg-type]


def run(engine: LLMEngine, ids: Sequence[int]) -> dict[int, tuple[list[int], str | None, object]]:
    """Step until idle; each request's tokens, finish reason and stop reason."""
    results: dict[int, tuple[list[int], str | None, object]] = {i: ([], None, None) for i in ids}
    while engine.has_work():
        for out in engine.step().outputs:
            tokens, _, _ = results[out.group_id]
            results[out.group_id] = (tokens + out.new_token_ids, out.finish_reason, out.stop_reason)
    return results


def assert_pool_whole(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.pool.num_blocks  # cached ones are evictable
    assert bm.num_free_host_blocks == bm.num_host_blocks
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_pool_too_small_for_the_running_set_gives_the_same_greedy_text(roomy: LLMEngine, mode: str) -> None:
    expected = [c.token_ids for c in roomy.generate(PROMPTS, GREEDY)]
    per_block = roomy.kv_cache.storage[:, :, :1].nbytes
    tight = sibling(roomy, block_size=4, kv_cache_memory=14 * per_block, swap_space=64 * per_block,
                    policy=SchedulingPolicy(preemption_mode=mode))
    assert tight.block_manager.pool.num_blocks == 14
    ids = [tight.add(p, GREEDY, priority=("interactive", "batch")[i % 2]) for i, p in enumerate(PROMPTS)]
    results = run(tight, ids)
    assert [results[i][0] for i in ids] == expected
    assert all(results[i][1] == "length" for i in ids)
    assert tight.scheduler.preemptions[mode] > 0, tight.scheduler.preemptions
    assert_pool_whole(tight)


def test_a_shared_system_prompt_is_computed_once(roomy: LLMEngine) -> None:
    engine = sibling(roomy, block_size=16, kv_cache_memory=64 * 2**20)
    words = " ".join(f"rule {i}: be kind to the number {i * 7 % 13}." for i in range(200))
    system = engine.tokenizer.encode(words)[:512]
    assert len(system) == 512
    first = system + engine.tokenizer.encode(" Q: what is rule 3?", add_special_tokens=False)
    second = system + engine.tokenizer.encode(" Q: which number is rule 41 kind to, exactly?",
                                              add_special_tokens=False)
    stats = engine.scheduler.stats["interactive"]
    [a] = engine.generate([first], GREEDY)
    assert stats.prompt_tokens == len(first) and stats.cached_prompt_tokens == 0
    [b] = engine.generate([second], GREEDY)
    # the second computed only its suffix; the 512 shared tokens came from the cache
    assert stats.prompt_tokens - len(first) == len(second) - 512
    assert stats.cached_prompt_tokens == 512
    assert engine.block_manager.prefix_hits == 512
    # and the cached blocks give exactly the tokens a cold engine computes
    cold = sibling(roomy, block_size=16, kv_cache_memory=64 * 2**20, enable_prefix_caching=False)
    [b_cold] = cold.generate([second], GREEDY)
    assert b.token_ids == b_cold.token_ids
    assert a.token_ids
    assert_pool_whole(engine)


def test_a_timeout_ends_the_request_and_its_unstarted_choices(roomy: LLMEngine) -> None:
    engine = sibling(roomy, block_size=4, kv_cache_memory=8 * 2**20)
    prompt = engine.tokenizer.encode("Hello")
    # it arrived a second ago with a 0.5 s TTFT limit: it ends at the first step
    late = 1000
    engine.add_request(EngineRequest(late, prompt, GREEDY, "interactive", n=3, timeouts=Timeouts(ttft=0.5),
                                     arrival_time=time.monotonic() - 1.0))
    fine = engine.add("Hello there", GREEDY)
    first = engine.step()
    assert first.started == [fine]  # the door hears that only `fine` left the queue by starting
    ended = sorted((o.index, o.new_token_ids, o.finished, o.finish_reason, o.stop_reason)
                   for o in first.outputs if o.group_id == late)
    assert ended == [(i, [], True, "timeout", "ttft") for i in range(3)]  # the choice and its forks
    results = run(engine, [late, fine])
    assert results[late] == ([], None, None)  # nothing more for it
    fine_first = [t for o in first.outputs if o.group_id == fine for t in o.new_token_ids]
    assert len(fine_first + results[fine][0]) == 16 and results[fine][1] == "length"
    assert engine.scheduler.timeouts == {"ttft": 1}
    assert_pool_whole(engine)
