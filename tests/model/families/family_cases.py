"""The harness of the family tests: a tiny random checkpoint written by transformers, served by
inferd's engine, and transformers' own greedy tokens as the reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tiny_models as tm
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.text.sampling_params import SamplingParams

NEW_TOKENS = 24
WINDOW = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@dataclass
class Case:
    folder: Path
    model: Any
    engine: LLMEngine
    prompts: list[list[int]]
    reference: list[list[int]]


def build(folder: Path, make: Callable[[int], Any], seed: int = 0,
          prepare: Callable[[Any], Any] = lambda model: model) -> Case:
    """`prepare`: a change to the randomized weights before they are saved."""
    vocab = tm.train_sentencepiece(folder)
    torch.manual_seed(seed)
    model = make(vocab)
    # (Gemma 2/3's norms are x̂·(1 + w); Gemma 4's, like Llama's, x̂·w)
    offset_norms = model.config.model_type.startswith("gemma") and not model.config.model_type.startswith("gemma4")
    model = prepare(tm.randomize(model, seed, norm_centre=0.0 if offset_norms else 1.0))
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder, safe_serialization=True)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=16 * 2**20))
    prompts = [engine.tokenizer.encode(p) for p in tm.PROMPTS]
    reference = tm.greedy_reference(model, prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)
    return Case(folder, model, engine, prompts, reference)


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    completions = engine.generate(prompts, GREEDY)
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    return [c.token_ids for c in completions]


def greedy_argmax(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits.argmax(-1)


def switched_off(case: Case, make: Callable[[int], Any], after: Callable[[Any], Any] = lambda model: model) -> bool:
    """transformers' argmax along the prompts with one feature off differs from the case's model
    (`make`: the model with the feature off, which gets the case's weights; `after`: a change to
    the weights once loaded)."""
    other = make(case.model.config.vocab_size)
    other.load_state_dict(case.model.state_dict(), strict=False)
    other = after(other)
    other.eval()
    ids = [t for p in case.prompts for t in p] + case.reference[0]  # past the window
    return not torch.equal(greedy_argmax(case.model, ids), greedy_argmax(other, ids))


def family_fixtures(families: dict[str, Callable[[int], Any]],
                    prepare: Callable[[Any], Any] = lambda model: model) -> tuple[Any, Any]:
    """A test module's two fixtures, `cases, case = family_fixtures(FAMILIES)`: `cases(name)`, each
    family's case built on first use (once a module), and `case`, parametrized over the families."""
    @pytest.fixture(scope="module")
    def cases(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Case]:
        built: dict[str, Case] = {}

        def get(family: str) -> Case:
            if family not in built:
                built[family] = build(tmp_path_factory.mktemp(family), families[family], prepare=prepare)
            return built[family]

        return get

    @pytest.fixture(params=list(families))
    def case(request: pytest.FixtureRequest, cases: Callable[[str], Case]) -> Case:
        return cases(request.param)

    return cases, case


def assert_alone_and_batched(case: Case) -> None:
    """Greedy tokens equal transformers' for every prompt alone, then for all in one ragged batch."""
    for prompt, expected in zip(case.prompts, case.reference):
        assert generate(case.engine, [prompt]) == [expected]
    assert generate(case.engine, case.prompts) == case.reference


def chunked_engine(case: Case) -> LLMEngine:
    """The case's model with prefill chunks of 5 tokens."""
    return LLMEngine.from_config(EngineConfig.of(model=str(case.folder), dtype="float32", kv_cache_memory=16 * 2**20,
                                                 max_num_batched_tokens=5))
