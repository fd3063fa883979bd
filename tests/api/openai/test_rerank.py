"""POST /v1/rerank and /v1/score on a tiny Qwen3-Reranker-style model (a random Qwen3ForCausalLM
written by transformers, served with task "score"): each score is sigmoid(logit[yes] - logit[no])
at the last position of Qwen3-Reranker's prompt, as transformers computes it; rerank's results
best first, cut to top_n; score's 1:N and N:N pairings; a reranker answers no embeddings."""

from __future__ import annotations

import math
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from apiserver import Server, assert_error, serve

from inferd.api.openai.embeddings import reranker_prompt
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.settings.config import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "model"))
import tiny_models as tm  # noqa: E402  (tests/model's builders of tiny checkpoints)

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

MODEL = "reranker"
QUERY = "Where does the fox jump?"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "Der Hund schläft.", "def fib(n): return n",
             "Le renard brun rapide saute par-dessus le chien paresseux."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(folder, transformers model, transformers tokenizer) of a tiny reranker whose vocabulary
    spells "yes" and "no" in one token each."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("reranker")
    vocab = tm.train_byte_level_bpe(folder, text=tm.CORPUS + "yes\nno\n" * 20)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = tm.randomize(Qwen3ForCausalLM(config), seed=0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model, AutoTokenizer.from_pretrained(folder)


@pytest_asyncio.fixture
async def server(checkpoint: tuple[Path, Any, Any]) -> AsyncIterator[Server]:
    llm = LLMEngine.from_config(EngineConfig.of(model=str(checkpoint[0]), dtype="float32", task="score",
                                                kv_cache_memory=16 * 2**20))
    settings = Settings()
    settings = settings.model_copy(update={"model": settings.model.model_copy(update={"name": MODEL}),
                                           "limits": settings.limits.model_copy(update={"max_prompts": 8})})
    async with serve(llm, settings) as s:
        yield s


def reference(checkpoint: tuple[Path, Any, Any], query: str, document: str, instruction: str | None = None
              ) -> tuple[float, int]:
    """transformers' P(yes) of the pair (the model card's recipe), and its prompt's length."""
    _, model, tokenizer = checkpoint
    ids = [t for part in reranker_prompt(query, document, instruction)
           for t in tokenizer(part, add_special_tokens=False)["input_ids"]]
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return 1 / (1 + math.exp(-float(logits[yes] - logits[no]))), len(ids)


async def test_rerank_scores_are_p_yes_best_first(server: Server, checkpoint: tuple[Path, Any, Any]) -> None:
    _, _, tokenizer = checkpoint
    assert len(tokenizer("yes", add_special_tokens=False)["input_ids"]) == 1
    expected = [reference(checkpoint, QUERY, d) for d in DOCUMENTS]
    status, body = await server.post("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    results = body["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]][0], abs=1e-4)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 4
    tokens = sum(n for _, n in expected)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    status, top = await server.post("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                                   "return_documents": False})
    assert status == 200, top
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    assert all(r["document"] is None for r in top["results"])


async def test_score_pairs_one_to_n_and_n_to_n(server: Server, checkpoint: tuple[Path, Any, Any]) -> None:
    status, body = await server.post("/v1/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS[:3]})
    assert status == 200, body
    assert body["object"] == "list" and body["id"].startswith("score-") and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    for d, document in zip(body["data"], DOCUMENTS):
        assert d["score"] == pytest.approx(reference(checkpoint, QUERY, document)[0], abs=1e-4)
    # N:N, with an instruction of the caller's
    queries, instruction = ["Which text is German?", "Which text is code?"], "Find the text the query asks for"
    status, body = await server.post("/v1/score", {"model": MODEL, "text_1": queries, "text_2": DOCUMENTS[1:3],
                                                   "instruction": instruction})
    assert status == 200, body
    for d, q, document in zip(body["data"], queries, DOCUMENTS[1:3]):
        assert d["score"] == pytest.approx(reference(checkpoint, q, document, instruction)[0], abs=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(reference(checkpoint, q, d, instruction)[1]
                                                 for q, d in zip(queries, DOCUMENTS[1:3]))


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", None),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1", None),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", None),
    ("/v1/rerank", {"query": "q", "documents": ["d"] * 9}, "documents", None),  # (max_prompts: 8)
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", None),
    ("/v1/rerank", {"query": "q " * 2000, "documents": ["d"]}, "documents", "context_length_exceeded"),
    ("/v1/embeddings", {"input": "Hello"}, "model", "wrong_task"),
])
async def test_bad_requests_are_400s(server: Server, path: str, body: dict, param: str, code: str | None) -> None:
    assert_error(*await server.post(path, {"model": MODEL, **body}), 400, param=param, code=code)
