"""Speculative decoding in the engine, on the default model: the tokens it hands out are the ones
decoding one token a step gives (greedy and seeded, token for token, under batching, chunked
prefill and preemption; unseeded, in distribution), every sampling option composes, and the
pool is whole afterwards."""

from __future__ import annotations

import collections
import math
from typing import Any

import pytest


from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import Completion, LLMEngine
from inferd.engine.protocol import EngineRequest
from inferd.engine.structured.grammar import GrammarCompiler, json_schema_grammar
from inferd.settings.policy import SchedulingPolicy
from inferd.text.sampling_params import SamplingParams

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass lamp and "
           "a notebook in which he wrote the names of the ships that passed the rocky point, the direction of the "
           "wind, and the colour of the sea, which changed from grey to green to a deep and restless blue.")
COPY = f"Passage: {PASSAGE}\nThe same passage again: {PASSAGE}\nAnd once more, word for word:"
OTHER = "Write a short list of three fruits and say which one you like best."


def engine(weights: tuple[Any, Any], method: str, **keys: Any) -> LLMEngine:
    model, tokenizer = weights
    return LLMEngine(model, tokenizer, EngineConfig.of(speculative=method, **keys))


def run(weights: tuple[Any, Any], method: str, prompts: list[str], params: list[SamplingParams],
        **keys: Any) -> tuple[list[Completion], LLMEngine]:
    eng = engine(weights, method, **keys)
    out = eng.generate(prompts, params)
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests
    return out, eng


def same(a: list[Completion], b: list[Completion]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert x.finish_reason == y.finish_reason
        assert (x.logprobs is None) == (y.logprobs is None)
        for p, q in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert p.token_id == q.token_id and p.logprob == q.logprob and p.top == q.top


def test_greedy_tokens_are_the_same_with_every_option_batched(served_weights) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    prompts = [COPY, COPY, OTHER, COPY, COPY, COPY, COPY[:200]]
    params = [
        greedy,
        SamplingParams(temperature=0.0, max_tokens=60, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=60, stop=["restless"]),  # a stop inside the copy
        SamplingParams(temperature=0.0, max_tokens=60, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=60, logit_bias=((15, 5.0),)),
        SamplingParams(temperature=0.0, max_tokens=23),  # max_tokens inside an accepted run
    ]
    off, _ = run(served_weights, "off", prompts, params)
    on, eng = run(served_weights, "suffix", prompts, params)
    same(off, on)
    assert eng.speculator.accepted_tokens > 40, eng.speculator.snapshot()
    assert off[3].finish_reason == "stop" and "restless" not in off[3].text
    assert len(off[6].token_ids) == 23


def test_seeded_sampling_gives_the_same_tokens(served_weights) -> None:
    params = [SamplingParams(temperature=t, seed=s, max_tokens=48, top_p=p, top_k=k)
              for t, s, p, k in ((0.3, 1, 1.0, 0), (0.7, 2, 0.9, 0), (1.0, 3, 1.0, 20), (0.5, 4, 0.95, 40))]
    off, _ = run(served_weights, "off", [COPY] * 4, params)
    on, eng = run(served_weights, "suffix", [COPY] * 4, params)
    same(off, on)
    assert eng.speculator.accepted_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.soak)])
def test_n_choices_and_preemption(served_weights, mode: str) -> None:
    """A pool of 12 blocks for copying requests (one of them with two choices, forked): preempted
    (recomputed or swapped) midway, each the same as without speculation and without preemption."""
    prompts = [COPY[:300], COPY[:280], COPY[:260]]
    params = [SamplingParams(temperature=0.0, max_tokens=70), SamplingParams(temperature=0.0, max_tokens=70),
              SamplingParams(temperature=0.8, seed=7, max_tokens=70)]
    small = {"kv_cache_memory": 12 * 16 * 30 * 2 * 3 * 64 * 2, "max_num_batched_tokens": 64,
             "policy": SchedulingPolicy(preemption_mode=mode)}
    answers = {}
    for method, keys in (("off", {}), ("suffix", small)):
        eng = engine(served_weights, method, **keys)
        for group, (text, p) in enumerate(zip(prompts, params)):
            eng.add_request(EngineRequest(group, eng.tokenizer.encode(text), p, "interactive", n=2 if group == 2 else 1))
        tokens = collections.defaultdict(list)
        while eng.has_work():
            for out in eng.step().outputs:
                tokens[out.group_id, out.index] += out.new_token_ids
        answers[method] = dict(tokens)
        eng.block_manager.check_invariants()
        assert eng.block_manager.num_used_blocks == 0
    assert eng.scheduler.num_preemptions > 0
    assert eng.speculator.accepted_tokens > 0
    assert answers["off"] == answers["suffix"]
    assert answers["off"][2, 0] != answers["off"][2, 1]


def test_unseeded_samples_keep_their_distribution(served_weights) -> None:
    """The second and third tokens of a copy sampled at temperature 1, 160 times each way: a draft
    is taken only where it is what the row before it sampled, so the two distributions are the
    same (two-sample chi-square over the pairs seen; p > 0.001)."""
    short = "Passage: the cat sat on the mat and looked at the moon.\nAgain, word for word: the cat sat on the"
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    counts = {}
    for method in ("off", "suffix"):
        out, eng = run(served_weights, method, [short] * 160, params, max_num_seqs=160)
        counts[method] = collections.Counter(tuple(c.token_ids[1:3]) for c in out)
    assert eng.speculator.accepted_tokens > 30
    assert chi_square_p(counts["off"], counts["suffix"]) > 1e-3, counts


def chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of homogeneity, rare outcomes pooled (expected count < 5)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    cells, rare = [], [0, 0]
    for k in keys:
        if (a[k] + b[k]) * min(na, nb) / (na + nb) >= 5:
            cells.append((a[k], b[k]))
        else:
            rare[0] += a[k]
            rare[1] += b[k]
    if sum(rare):
        cells.append(tuple(rare))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return chi2_sf(stat, dof)


def chi2_sf(x: float, k: int) -> float:
    """The chi-square survival function (Wilson-Hilferty: close enough for a 1e-3 bound)."""
    if k <= 0:
        return 1.0
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_a_grammar_request_drafts_nothing_beside_one_that_does(served_weights) -> None:
    """A grammar's rows would each need its mask advanced through the drafts before them: a
    constrained request decodes one token a step, its neighbour speculates, both as without."""
    answers = {}
    for method in ("off", "suffix"):
        eng = engine(served_weights, method)
        ids = eng.tokenizer.encode(COPY)
        grammar = GrammarCompiler(eng.tokenizer).compile(json_schema_grammar(
            {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}))
        eng.add_request(EngineRequest(1, ids, SamplingParams(temperature=0.0, max_tokens=60), "interactive",
                                      constraint=grammar))
        eng.add_request(EngineRequest(2, ids, SamplingParams(temperature=0.0, max_tokens=60), "interactive"))
        texts = collections.defaultdict(str)
        while eng.has_work():
            for out in eng.step().outputs:
                texts[out.group_id] += out.text
        answers[method] = dict(texts)
        assert eng.block_manager.num_used_blocks == 0
    assert answers["off"] == answers["suffix"]
    assert answers["off"][1].lstrip().startswith("{")
    assert eng.speculator.accepted_tokens > 0


def test_auto_drafts_nothing_above_its_batch_limit(served_weights) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    out, eng = run(served_weights, "auto", [COPY] * 6, params, spec_max_batch=4, max_num_batched_tokens=2048)
    snap = eng.speculator.snapshot()
    assert snap.steps_off > 0 and snap.drafted_tokens == 0  # (all six decode together, to the end)
    out1, eng1 = run(served_weights, "auto", [COPY] * 2, params, spec_max_batch=4)
    assert eng1.speculator.accepted_tokens > 0
    assert out[0].token_ids == out1[0].token_ids


def test_usage_counts_the_drafts(served_weights) -> None:
    eng = engine(served_weights, "suffix")
    outs = list(eng.stream(COPY, SamplingParams(temperature=0.0, max_tokens=50)))
    final = outs[-1]
    assert final.finished and final.metrics is not None
    assert final.metrics.drafted_tokens >= final.metrics.accepted_tokens > 0
    assert sum(len(o.new_token_ids) for o in outs) == final.metrics.output_tokens
    assert len(outs) < final.metrics.output_tokens  # several tokens in some steps' outputs


def test_a_tenant_that_opted_in_drafts_from_its_own_earlier_outputs(served_weights) -> None:
    """The second request writes what the first one wrote (the same prompt, greedy): drafted from
    the tenant's history, most of it is accepted; another tenant never drafts from that history,
    and without the opt-in nothing is kept."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    accepted = {}
    for tenant, opted in (("a", True), ("b", False)):
        eng = engine(served_weights, "suffix")
        ids = eng.tokenizer.encode("Write one sentence about a red boat on a calm lake.")
        list(run_one(eng, EngineRequest(1, ids, params, "interactive", tenant=tenant, draft_history=opted)))
        outs = list(run_one(eng, EngineRequest(2, ids, params, "interactive", tenant=tenant, draft_history=opted)))
        accepted[tenant] = outs[-1].metrics.accepted_tokens
        other = list(run_one(eng, EngineRequest(3, ids, params, "interactive", tenant="c", draft_history=True)))
        assert other[-1].metrics.accepted_tokens < 16  # c's history is its own (empty)
    assert accepted["a"] >= 16 > accepted["b"]


def run_one(eng: LLMEngine, request: EngineRequest):
    eng.add_request(request)
    while eng.has_work():
        yield from eng.step().outputs
