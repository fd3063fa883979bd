"""Grammar-constrained decoding on the real default model: every answer follows its grammar,
greedy and sampled, alone and batched beside free rows; n > 1 choices each keep their own
matcher; preemption by recompute and swap keep the matcher's state; a failing constraint fails
its request alone."""

from __future__ import annotations

import json
from collections.abc import Sequence

import jsonschema
import pytest

from inferd.engine.config import EngineConfig
from inferd.engine.structured.grammar import (
    GrammarCompiler,
    GrammarError,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.policy import SchedulingPolicy
from inferd.engine.protocol import EngineRequest
from inferd.text.sampling_params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                   "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(float32_weights: tuple) -> LLMEngine:
    return LLMEngine(*float32_weights, EngineConfig.of(dtype="float32", kv_cache_memory=64 * 2**20, block_size=4))


@pytest.fixture(scope="module")
def compiler(engine: LLMEngine) -> GrammarCompiler:
    return GrammarCompiler(engine.tokenizer)


def prompt(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def run(engine: LLMEngine, requests: Sequence[EngineRequest]) -> dict[tuple[int, int], tuple[str, str | None]]:
    """Each (group, choice)'s text and finish reason."""
    for r in requests:
        engine.add_request(r)
    texts: dict[tuple[int, int], str] = {}
    finish: dict[tuple[int, int], str | None] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            key = (out.group_id, out.index)
            texts[key] = texts.get(key, "") + out.text
            if out.finished:
                finish[key] = out.finish_reason
    return {k: (texts.get(k, ""), finish[k]) for k in finish}


def assert_pool_whole(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and not engine.scheduler.running and not engine.scheduler.waiting


def test_schema_answers_validate_greedy_sampled_and_beside_free_rows(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    grammar = json_schema_grammar(PERSON)
    ids = prompt(engine, "Describe a person as JSON.")
    requests = [EngineRequest(1000 + seed, ids, SamplingParams(max_tokens=80, temperature=1.0, seed=seed),
                              "interactive", n=2, constraint=compiler.compile(grammar)) for seed in range(6)]
    requests.append(EngineRequest(1100, ids, SamplingParams(max_tokens=80, temperature=0), "interactive",
                                  constraint=compiler.compile(grammar)))
    free = EngineRequest(1200, ids, SamplingParams(max_tokens=20, temperature=0), "interactive")
    results = run(engine, [*requests, free])
    assert len(results) == 6 * 2 + 2
    for (group, _), (text, finish) in results.items():
        if group == 1200:
            assert not text.lstrip().startswith("{")  # the free row was not masked by its neighbours
            continue
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    sampled = {results[(1000 + s, i)][0] for s in range(6) for i in range(2)}
    assert len(sampled) > 6  # seeds and choices differ: each choice drew its own tokens
    assert_pool_whole(engine)


@pytest.mark.parametrize("grammar, check", [
    (json_object_grammar(), lambda t: isinstance(json.loads(t), dict)),
    (regex_grammar(r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
    (choice_grammar(["yes", "no", "maybe (not sure)"]), lambda t: t in ("yes", "no", "maybe (not sure)")),
    (lark_grammar('start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'),
     lambda t: t.startswith("The answer is ") and t.endswith(".") and t[14:-1].isdigit()),
], ids=["json_object", "regex", "choice", "lark"])
def test_every_kind_of_grammar_binds_sampled_text(engine: LLMEngine, compiler: GrammarCompiler, grammar: str, check) -> None:
    ids = prompt(engine, "Answer.")
    requests = [EngineRequest(2000 + s, ids, SamplingParams(max_tokens=120, temperature=1.0, seed=s), "interactive",
                              constraint=compiler.compile(grammar)) for s in range(4)]
    for text, finish in run(engine, requests).values():
        assert finish == "stop" and check(text), text


def person_requests(engine: LLMEngine, compiler: GrammarCompiler) -> list[EngineRequest]:
    """Four greedy JSON persons, each with a matcher of its own."""
    grammar = json_schema_grammar(PERSON)
    params = SamplingParams(max_tokens=60, temperature=0)
    return [EngineRequest(3000 + i, prompt(engine, f"Person number {i}, as JSON."), params, "interactive",
                          constraint=compiler.compile(grammar)) for i in range(4)]


@pytest.fixture(scope="module")
def persons_unpreempted(engine: LLMEngine, compiler: GrammarCompiler) -> dict:
    """person_requests' answers on the roomy engine (no preemption): what both modes must give."""
    return run(engine, person_requests(engine, compiler))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_matcher_state(engine: LLMEngine, compiler: GrammarCompiler, mode: str,
                                            persons_unpreempted: dict) -> None:
    expected = persons_unpreempted
    per_block = engine.kv_cache.storage[:, :, :1].nbytes
    tight = LLMEngine(engine.model, engine.tokenizer, EngineConfig.of(
        dtype="float32", block_size=4, kv_cache_memory=40 * per_block, swap_space=64 * per_block,
        policy=SchedulingPolicy(preemption_mode=mode)))
    got = run(tight, person_requests(engine, compiler))
    assert tight.scheduler.preemptions[mode] > 0
    assert got == expected
    for text, _ in got.values():
        jsonschema.validate(json.loads(text), PERSON)
    assert_pool_whole(tight)


class Refuses:
    """A constraint whose matcher breaks after its first token."""

    def __init__(self) -> None:
        self.accepted = 0

    def fill_mask(self, mask) -> None:  # noqa: ANN001 - numpy row
        if self.accepted:
            raise RuntimeError("broken constraint")

    def accept(self, token_id: int) -> None:
        self.accepted += 1

    def fork(self) -> Refuses:
        return Refuses()


def test_a_failing_constraint_fails_its_request_alone(engine: LLMEngine) -> None:
    ids = prompt(engine, "Hello")
    bad = EngineRequest(4000, ids, SamplingParams(max_tokens=8, temperature=0), "interactive", constraint=Refuses())
    good = EngineRequest(4001, ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "interactive")
    results = run(engine, [bad, good])
    assert results[(4000, 0)][1] == "error"
    assert results[(4001, 0)][1] == "length"
    assert_pool_whole(engine)


@pytest.mark.parametrize("make", [
    lambda: json_schema_grammar({"type": "integer", "minimum": 5, "maximum": 1}),
    lambda: json_schema_grammar({"type": "strnig"}),
    lambda: json_schema_grammar({"type": "object", "propertyNames": {"maxLength": 3}}),  # strict: not implemented
    lambda: regex_grammar("(unclosed"),
    lambda: lark_grammar("start: undefined_rule"),
], ids=["empty-range", "bad-type", "unsupported-keyword", "regex", "lark"])
def test_a_grammar_that_does_not_compile_names_its_problem(compiler: GrammarCompiler, make) -> None:
    with pytest.raises(GrammarError) as e:
        compiler.compile(make())
    assert str(e.value)


def test_a_lenient_schema_ignores_what_it_does_not_implement(compiler: GrammarCompiler) -> None:
    compiler.compile(json_schema_grammar({"type": "object", "propertyNames": {"maxLength": 3}}, strict=False))


def test_text_a_grammar_forces_mid_answer_takes_no_sentencepiece_space(tmp_path) -> None:
    """A SentencePiece vocabulary prefixes a text's first word with "▁"; the text a grammar forces
    sits mid-answer, so it is encoded without it (else the grammar refuses its own forced token)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "model"))
    import tiny_models as tm

    from inferd.engine.structured.grammar import _TokenizerView

    vocab = tm.train_sentencepiece(tmp_path)
    tm.tiny_llama(vocab).save_pretrained(tmp_path, safe_serialization=True)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(tmp_path), dtype="float32", kv_cache_memory=2**22))
    tokenizer = engine.tokenizer
    assert tokenizer.token_bytes(tokenizer.encode("<tool_call>", add_special_tokens=False)[0]) == b" "
    view = _TokenizerView(tokenizer)
    assert b"".join(tokenizer.token_bytes(t) for t in view("<tool_call>")) == b"<tool_call>"
    grammar = lark_grammar('start: "<tool_call>\\n<function=" /[a-z]{3}/ ">"')
    request = EngineRequest(4000, prompt(engine, "Call."), SamplingParams(max_tokens=40, temperature=0), "interactive",
                            constraint=GrammarCompiler(tokenizer, engine.model_config.vocab_size).compile(grammar))
    [(text, finish)] = run(engine, [request]).values()
    assert finish == "stop" and text.startswith("<tool_call>\n<function=") and text.endswith(">"), text
