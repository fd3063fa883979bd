"""A fuzz over sampling options x grammar x preemption with speculation on: whatever the mix, no
request fails, none is lost, the pool is whole afterwards, and the greedy unconstrained requests
give the tokens they give without speculation (the soak tier runs more examples)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.protocol import EngineRequest
from inferd.engine.structured.grammar import GrammarCompiler, json_object_grammar
from inferd.text.sampling_params import SamplingParams

PASSAGE = "The keeper lit the lamp, wrote the ships' names in his book, and watched the grey sea turn blue."
PROMPTS = [f"Passage: {PASSAGE}\nAgain: {PASSAGE}\nOnce more:", "List three colours.", f"{PASSAGE} {PASSAGE}"]

options = st.fixed_dictionaries({
    "prompt": st.integers(0, len(PROMPTS) - 1),
    "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.0]),
    "seed": st.one_of(st.none(), st.integers(0, 1000)),
    "top_p": st.sampled_from([1.0, 0.9]),
    "top_k": st.sampled_from([0, 20]),
    "min_p": st.sampled_from([0.0, 0.05]),
    "presence_penalty": st.sampled_from([0.0, 0.6]),
    "frequency_penalty": st.sampled_from([0.0, 0.4]),
    "logit_bias": st.sampled_from([(), ((28, 2.0),)]),
    "logprobs": st.sampled_from([None, 0, 2]),
    "stop": st.sampled_from([(), ("sea",), ("\n",)]),
    "max_tokens": st.integers(1, 40),
    "ignore_eos": st.booleans(),
    "n": st.sampled_from([1, 1, 2]),
    "grammar": st.booleans(),
})


@pytest.fixture(scope="module")
def engines(served_weights) -> dict[str, LLMEngine]:
    model, tokenizer = served_weights
    # a pool of 9 blocks of 16 tokens: the longest request fits alone, two at once preempt each other
    small = EngineConfig.of(speculative="suffix", kv_cache_memory=9 * 16 * 30 * 2 * 3 * 64 * 2,
                            max_num_batched_tokens=64)
    return {"suffix": LLMEngine(model, tokenizer, small),
            "off": LLMEngine(model, tokenizer, EngineConfig.of(speculative="off"))}


def run(engine: LLMEngine, mixes: list[dict[str, Any]], compiler: GrammarCompiler) -> dict[tuple[int, int], tuple]:
    for group, o in enumerate(mixes):
        params = SamplingParams(temperature=o["temperature"], seed=o["seed"], top_p=o["top_p"], top_k=o["top_k"],
                                min_p=o["min_p"], presence_penalty=o["presence_penalty"],
                                frequency_penalty=o["frequency_penalty"], logit_bias=o["logit_bias"],
                                logprobs=o["logprobs"], stop=o["stop"], max_tokens=o["max_tokens"],
                                ignore_eos=o["ignore_eos"])
        constraint = compiler.compile(json_object_grammar()) if o["grammar"] else None
        engine.add_request(EngineRequest(10_000 + group, engine.tokenizer.encode(PROMPTS[o["prompt"]]), params,
                                         "interactive", n=o["n"], constraint=constraint))
    results: dict[tuple[int, int], list] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            tokens, _ = results.setdefault((out.group_id, out.index), ([], []))
            tokens += out.new_token_ids
            if out.finished:
                results[out.group_id, out.index][1].append(out.finish_reason)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests
    return {k: (tuple(tokens), tuple(ends)) for k, (tokens, ends) in results.items()}


@pytest.mark.parametrize("examples", [pytest.param(40, marks=pytest.mark.soak), 6])
def test_any_mix_of_options_finishes_every_request_and_keeps_greedy_tokens(engines, examples: int) -> None:
    compiler = GrammarCompiler(engines["off"].tokenizer)

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.lists(options, min_size=2, max_size=5))
    def check(mixes: list[dict[str, Any]]) -> None:
        on = run(engines["suffix"], mixes, compiler)
        off = run(engines["off"], mixes, compiler)
        expected = {(10_000 + g, i) for g, o in enumerate(mixes) for i in range(o["n"])}
        assert set(on) == expected == set(off)
        for (group, index), (tokens, ends) in on.items():
            assert ends and ends[0] in ("stop", "length"), (group, ends)
            o = mixes[group - 10_000]
            if o["temperature"] == 0 or o["seed"] is not None:  # the same tokens, with or without
                assert (tokens, ends) == off[group, index], o

    check()
    assert engines["suffix"].scheduler.num_preemptions > 0 and engines["suffix"].speculator.accepted_tokens > 0
