"""The model side of the pooling models: tiny Qwen3-Embedding- and EmbeddingGemma-like checkpoints
written here (pooling_checkpoints.py), read by inferd's loader, tokenizer and pooler, and compared
with sentence-transformers' vectors; the sentence-transformers modules inferd refuses; the
bidirectional attention plan.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers")
pytest.importorskip("sentencepiece")

import pooling_checkpoints as pc
import tiny_models as tm

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.protocol import EngineRequest, PoolingParams
from inferd.kernels import reference
from inferd.model.pooling import load_pooler
from inferd.text.errors import ModelLoadError
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer_loader import load_tokenizer


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pc.qwen3_embedding(tmp_path_factory.mktemp("qwen3_embedding"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pc.embedding_gemma(tmp_path_factory.mktemp("embedding_gemma"))


# ------------------------------------------------------------------ against sentence-transformers


def test_qwen3_embedding_matches_sentence_transformers(qwen: Path) -> None:
    model, _, pooler = pc.load(qwen)
    assert model.cfg.tie_word_embeddings and not model.cfg.bidirectional  # (a trunk alone: no lm_head)
    assert (pooler.method, pooler.normalize, pooler.dense, pooler.dimensions) == ("last", True, [], pc.HIDDEN)
    torch.testing.assert_close(pc.embed(qwen, pc.TEXTS), pc.reference_vectors(qwen, pc.TEXTS), atol=1e-5, rtol=0)


def test_embedding_gemma_matches_sentence_transformers(gemma: Path) -> None:
    model, tokenizer, pooler = pc.load(gemma)
    assert model.cfg.bidirectional and model.cfg.sliding_window == pc.GEMMA_WINDOW // 2 + 1
    assert (pooler.method, pooler.normalize, [d.weight.shape for d in pooler.dense]) == (
        "mean", True, [(2 * pc.HIDDEN, pc.HIDDEN), (pc.HIDDEN, 2 * pc.HIDDEN)])
    assert min(len(tokenizer.encode_document(t)) for t in pc.TEXTS) > 2 * pc.GEMMA_WINDOW  # the window matters
    torch.testing.assert_close(pc.embed(gemma, pc.TEXTS), pc.reference_vectors(gemma, pc.TEXTS), atol=1e-5, rtol=0)


@pytest.mark.parametrize("change", [{"bidirectional": False}, {"sliding_window": 10_000}])
def test_embedding_gemma_needs_both_ways_and_the_window(gemma: Path, change: dict) -> None:
    """Plans that are causal, or that ignore the window, give other hidden states: the test above
    could not pass without either."""
    model, tokenizer, _ = pc.load(gemma)
    ids = tokenizer.encode_document(pc.TEXTS[0])
    right = pc.hidden_states(model, ids)
    model.cfg = replace(model.cfg, **change)  # (read by the plans alone: the layers hold their own)
    assert (pc.hidden_states(model, ids) - right).abs().max() > 1e-2


@pytest.mark.parametrize("which", ["qwen", "gemma", "sentencepiece"])
def test_encode_document_matches_transformers(which: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A tokenizer.json's post-processor (Qwen3-Embedding's <|endoftext|>, the <bos> ... <eos>
    transformers wrote for the Gemma folder); a tokenizer.model alone: add_bos_token / add_eos_token."""
    from transformers import AutoTokenizer

    if which == "sentencepiece":
        folder = tmp_path
        tm.train_sentencepiece(folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(config | {"add_eos_token": True}))
    else:
        folder = request.getfixturevalue(which)
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for text in [*pc.TEXTS, ""]:
        assert ours.encode_document(text) == theirs(text)["input_ids"]
    assert ours.encode_document("a")[-1] in ours.special_ids  # (the end token: not a plain piece)


# ------------------------------------------------------------------------------ the pooler alone


def test_settings_override_the_checkpoint(qwen: Path) -> None:
    pooler = load_pooler(str(qwen), pc.HIDDEN, method="mean", normalize=False)
    assert (pooler.method, pooler.normalize) == ("mean", False)
    assert load_pooler(str(qwen), pc.HIDDEN, normalize=False).method == "last"
    with pytest.raises(ModelLoadError, match="'max'"):
        load_pooler(str(qwen), pc.HIDDEN, method="max")


def test_dense_with_tanh_and_bias_matches_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers.base.modules import Dense

    torch.manual_seed(0)
    layers = [Dense(pc.HIDDEN, 48), Dense(48, 24, activation_function=torch.nn.Identity())]  # (tanh: the default)
    pooler = load_pooler(str(pc.dense_folder(tmp_path, layers)), pc.HIDDEN)
    assert [d.activation for d in pooler.dense] == ["tanh", "identity"] and not pooler.normalize
    x = torch.randn(3, pc.HIDDEN)
    with torch.no_grad():
        expected = layers[1]({"sentence_embedding": layers[0]({"sentence_embedding": x})["sentence_embedding"]})
    torch.testing.assert_close(pooler.project(x), expected["sentence_embedding"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("pooling", [{"pooling_mode": "max"}, {"pooling_mode": "weightedmean"},
                                     {"pooling_mode": ["mean", "max"]},
                                     {"pooling_mode_max_tokens": True}])  # (sentence-transformers < 5)
def test_other_pooling_modes_are_refused(tmp_path: Path, pooling: dict) -> None:
    folder = pc.dense_folder(tmp_path, [])
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": pc.HIDDEN} | pooling))
    with pytest.raises(ModelLoadError, match="pooling mode .*max|pooling mode 'weightedmean'"):
        load_pooler(str(folder), pc.HIDDEN)


def test_legacy_pooling_flags_are_read(tmp_path: Path) -> None:
    folder = pc.dense_folder(tmp_path, [])
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": pc.HIDDEN, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    assert load_pooler(str(folder), pc.HIDDEN).method == "last"


def test_pickled_dense_and_unknown_modules_are_refused(tmp_path: Path) -> None:
    from sentence_transformers.base.modules import Dense

    folder = pc.dense_folder(tmp_path, [Dense(pc.HIDDEN, 8)])
    (folder / "2_Dense" / "model.safetensors").rename(folder / "2_Dense" / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        load_pooler(str(folder), pc.HIDDEN)
    modules = json.loads((folder / "modules.json").read_text())
    modules[2] = {"idx": 2, "name": "2", "path": "", "type": "sentence_transformers.models.LayerNorm"}
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="LayerNorm"):
        load_pooler(str(folder), pc.HIDDEN)


def test_defaults_without_modules(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3Model"], "matryoshka_dimensions": [32]}))
    pooler = load_pooler(str(tmp_path), pc.HIDDEN)
    assert (pooler.method, pooler.normalize, pooler.matryoshka) == ("last", True, True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3TextModel"]}))
    assert (load_pooler(str(tmp_path), pc.HIDDEN).method, load_pooler(str(tmp_path), pc.HIDDEN).matryoshka) == (
        "mean", False)
    for source in (None, str(tmp_path / "model.gguf")):  # (a GGUF file: the defaults)
        pooler = load_pooler(source, pc.HIDDEN, normalize=False)
        assert (pooler.method, pooler.normalize, pooler.dimensions) == ("mean", False, pc.HIDDEN)


# ------------------------------------------------------------------------ the bidirectional plan


@pytest.mark.parametrize("window", [None, 3])
def test_bidirectional_plan_sees_both_ways(window: int | None) -> None:
    """Two prompts from position 0 (one padded to the other's length): each real query row sees
    every key of its prompt, within |q - k| < window; attention over the plan equals a dense one."""
    gen = torch.Generator().manual_seed(0)
    lens, block_size, heads, dim = [6, 9], 4, 2, 8
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    plan = reference.plan_attention(tables, torch.tensor(lens), torch.tensor(lens), block_size, window=window,
                                    bidirectional=True)
    for s, n in enumerate(lens):
        q, k = torch.arange(n)[:, None], torch.arange(max(lens))[None, :]
        expected = (k < n) & ((q - k).abs() < (window or n))  # [n, L]
        assert torch.equal(plan.mask[s, 0, :n], expected)
    key_cache, value_cache = (torch.randn(6, block_size, heads, dim, generator=gen) for _ in range(2))
    query = torch.randn(sum(lens), heads, dim, generator=gen)
    out = reference.attention_planned(query, key_cache, value_cache, plan, dim**-0.5)
    for s, n in enumerate(lens):
        slots = tables[s, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        k, v = (c.view(-1, heads, dim)[slots].transpose(0, 1) for c in (key_cache, value_cache))  # [H, n, D]
        q = query[sum(lens[:s]):sum(lens[:s]) + n].transpose(0, 1)  # [H, n, D]
        mask = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() < (window or n)
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5)
        torch.testing.assert_close(out[sum(lens[:s]):sum(lens[:s]) + n], dense.transpose(0, 1))


# ------------------------------------------------------------------ served by the engine


@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_the_engine_embeds_as_sentence_transformers_alone_and_batched(which: str,
                                                                      request: pytest.FixtureRequest) -> None:
    """Through LLMEngine with task "embed": each text alone, then all at once (last-token pooling in
    chunks of 8 tokens; bidirectional prompts whole, as many as a step of 48 tokens holds)."""
    folder = request.getfixturevalue(which)
    expected = pc.reference_vectors(folder, pc.TEXTS)
    for budget in (None, 8 if which == "qwen" else 48):
        keys = {"max_num_batched_tokens": budget} if budget else {}
        engine = LLMEngine.from_config(EngineConfig.of(model=str(folder), dtype="float32", task="embed",
                                                       kv_cache_memory=8 * 2**20, **keys))
        prompts = [engine.tokenizer.encode_document(t) for t in pc.TEXTS]
        limits = engine.limits.pooler
        assert limits is not None and limits.dimensions == expected.shape[1]
        step = engine.config.scheduler.max_num_batched_tokens  # (one step holds a bidirectional prompt)
        assert limits.max_prompt_tokens == min(engine.max_model_len - 1, step) if which == "gemma" \
            else limits.max_prompt_tokens == engine.max_model_len - 1
        assert which == "qwen" or max(map(len, prompts)) <= limits.max_prompt_tokens
        batches = [[p] for p in prompts] if budget is None else [prompts]
        vectors = [v for batch in batches for v in embed_all(engine, batch)]
        assert torch.allclose(torch.tensor(vectors), expected, atol=1e-5)


def embed_all(engine: LLMEngine, prompts: list[list[int]]) -> list[list[float]]:
    cls = engine.policy.lookup(engine.policy.pooling_default).name
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(i, ids, SamplingParams(max_tokens=1), cls, pooling=PoolingParams()))
    done: dict[int, list[float]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            if out.finished:
                assert out.pooled is not None, out
                done[out.group_id] = out.pooled
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    return [done[i] for i in range(len(prompts))]
