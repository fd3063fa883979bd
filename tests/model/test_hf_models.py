"""Hugging Face folders end to end: tiny random Llama / Qwen2 checkpoints, token for token against
transformers.

Each folder is written inside the test: `save_pretrained(safe_serialization=True)` weights plus a
tokenizer trained on the spot (SentencePiece `tokenizer.model` for Llama, byte-level BPE
`tokenizer.json` with ChatML specials for Qwen2). inferd loads the folder in float32 and its
greedy tokens must equal transformers' `generate(do_sample=False)`, each prompt alone and all of
them in one ragged batch. Also: a sharded checkpoint and Llama-3 rope scaling.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import tiny_models as tm  # noqa: E402 - after the skips

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.text.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def make_engine(path: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory=64 * 2**20))


@dataclass
class Case:
    folder: Path
    model: Any  # the transformers model
    engine: LLMEngine
    prompts: list[list[int]]
    reference: list[list[int]]


def build_case(folder: Path, train_tokenizer: Callable[[Path], int], make_model: Callable[..., Any]) -> Case:
    vocab_size = train_tokenizer(folder)
    model = make_model(vocab_size)
    model.save_pretrained(folder, safe_serialization=True)
    engine = make_engine(folder)
    prompts = [engine.tokenizer.encode(p) for p in tm.PROMPTS]
    reference = tm.greedy_reference(model, prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)
    return Case(folder, model, engine, prompts, reference)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("llama"), tm.train_sentencepiece, tm.tiny_llama)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return build_case(tmp_path_factory.mktemp("qwen2"), tm.train_byte_level_bpe, tm.tiny_qwen2)


@pytest.fixture(params=["llama", "qwen2"])
def case(request: pytest.FixtureRequest) -> Case:
    return request.getfixturevalue(request.param)


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    completions = engine.generate(prompts, GREEDY)
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    return [c.token_ids for c in completions]


# ------------------------------------------------------------------------------------ tokenizers


def test_tokenizer_matches_transformers(case: Case) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(case.folder)
    ours = case.engine.tokenizer
    for text in [tm.MULTILINGUAL, *tm.PROMPTS]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    ids = ours.encode(tm.MULTILINGUAL)
    assert len(ids) > 100 and hf.unk_token_id not in ids  # really tokenized, nothing mapped to unk
    if (case.folder / "tokenizer.model").is_file():  # SentencePiece: byte fallback was exercised
        assert any(ours.id_to_token(i).startswith("<0x") for i in ids)


def test_qwen2_chat_prompt_matches_transformers(qwen2: Case) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen2.folder)
    messages = [{"role": "user", "content": "Grüße! 你好"}]
    text = qwen2.engine.tokenizer.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = qwen2.engine.tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>")


# ------------------------------------------------------------------------------- greedy outputs


def test_config_read_from_folder(llama: Case, qwen2: Case) -> None:
    assert (llama.engine.model_config.architecture, llama.engine.model_config.tie_word_embeddings) == ("llama", False)
    assert (qwen2.engine.model_config.architecture, qwen2.engine.model_config.tie_word_embeddings) == ("qwen2", True)
    assert qwen2.engine.model_config.attention_bias


def test_greedy_alone_matches_transformers(case: Case) -> None:
    for prompt, expected in zip(case.prompts, case.reference):
        assert generate(case.engine, [prompt]) == [expected]


def test_greedy_batch_matches_transformers(case: Case) -> None:
    assert generate(case.engine, case.prompts) == case.reference


def test_sharded_checkpoint(llama: Case, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    llama.model.save_pretrained(folder, safe_serialization=True, max_shard_size="60KB")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(llama.folder / name, folder / name)
    assert len(list(folder.glob("*.safetensors"))) >= 3
    assert (folder / "model.safetensors.index.json").is_file()
    assert generate(make_engine(folder), llama.prompts) == llama.reference


# ------------------------------------------------------------------------------ rope scaling

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama3_rope_scaling(tmp_path: Path) -> None:
    """~100-token prompts, past `original_max_position_embeddings` (64), where scaling changes logits."""
    folder = tmp_path / "llama3"
    vocab_size = tm.train_sentencepiece(folder)
    model = tm.tiny_llama(vocab_size, seed=1, max_position_embeddings=512, rope_scaling=LLAMA3_SCALING)
    model.save_pretrained(folder, safe_serialization=True)
    engine = make_engine(folder)
    assert (engine.model_config.rope_scaling or {}).get("rope_type") == "llama3"
    text_ids = engine.tokenizer.encode(tm.CORPUS * 2, add_special_tokens=False)
    bos = engine.tokenizer.bos_token_id
    prompts = [[bos, *text_ids[start : start + length]] for start, length in ((0, 100), (150, 110), (300, 95))]

    # the scaling matters here: without it the same weights pick other tokens along the prompt
    unscaled = tm.tiny_llama(vocab_size, seed=1, max_position_embeddings=512)
    unscaled.load_state_dict(model.state_dict())
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        assert not torch.equal(model(ids).logits.argmax(-1), unscaled(ids).logits.argmax(-1))

    reference = tm.greedy_reference(model, prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)
    assert generate(engine, prompts) == reference
    assert generate(engine, prompts[:1]) == reference[:1]
