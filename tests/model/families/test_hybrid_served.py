"""A hybrid model (Qwen3.5: three linear-attention layers to one full) served by a real `inferd
serve`, through the official openai client: a conversation of three turns on /v1/completions,
each prompt the last one plus its answer plus new text, resumes each later turn from the prefix
cache's state checkpoints (cached_tokens >= 0.9 x the last turn's prompt), with the answers of
a server that caches nothing; /metrics and /v1/status count the checkpoints."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))
import tiny_models as tm  # noqa: E402
from serveproc import Server, start_server, stop_server  # noqa: E402
from test_gated_deltanet import qwen3_5, randomized  # noqa: E402

pytestmark = pytest.mark.served  # it starts real servers

# (a first turn of some length: a hit ends at a block end, and a random model's answer, re-tokenized
# with the next turn, may share no whole block with the answer as generated)
TURNS = ["The quick brown fox jumps over the lazy dog. " * 12, " Then the dog said: ", " And the fox answered that "]


def write_tiny_qwen35(folder: Path, byte_level: bool = False) -> Path:
    vocab = tm.train_byte_level_bpe(folder) if byte_level else tm.train_sentencepiece(folder)
    torch.manual_seed(0)
    randomized(qwen3_5(vocab, max_position_embeddings=1024)).save_pretrained(folder, safe_serialization=True)
    return folder


def conversation(server: Server) -> list[tuple[str, int, int]]:
    """(answer, prompt tokens, cached tokens) of each turn."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    prompt, turns = "", []
    for text in TURNS:
        prompt += text
        done = client.completions.create(model="qwen35", prompt=prompt, max_tokens=24, temperature=0)
        usage = done.usage
        assert usage is not None
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        turns.append((done.choices[0].text, usage.prompt_tokens, cached or 0))
        prompt += done.choices[0].text
    return turns


def test_a_conversation_resumes_from_state_checkpoints_with_the_uncached_answers(tmp_path: Path) -> None:
    folder = write_tiny_qwen35(tmp_path / "qwen35")
    args = ("--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "32MiB", "--block-size", "16")
    server = start_server(tmp_path, *args)
    try:
        cached = conversation(server)
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        with urllib.request.urlopen(f"{server.url}/v1/status", timeout=10) as r:
            status = json.load(r)
    finally:
        stop_server(server)
    uncached_dir = tmp_path / "uncached"
    uncached_dir.mkdir()
    server = start_server(uncached_dir, *args, "--no-prefix-caching")
    try:
        uncached = conversation(server)
    finally:
        stop_server(server)
    assert [answer for answer, _, _ in cached] == [answer for answer, _, _ in uncached]
    assert all(answer for answer, _, _ in cached)
    for (_, previous_prompt, _), (_, _, hit) in zip(cached, cached[1:]):
        assert hit >= 0.9 * previous_prompt, cached
    assert all(hit == 0 for _, _, hit in uncached)
    state = status["state_slots"]
    assert state["checkpoint_hits"] >= 2 and state["checkpoints"] >= 1 and state["checkpoint_bytes"] > 0
    assert "inferd_state_checkpoint_hits_total" in metrics and "inferd_state_checkpoint_bytes" in metrics


@pytest.mark.asyncio
async def test_a_forced_call_in_qwen35s_xml_format_comes_back_typed_by_the_schema(tmp_path: Path) -> None:
    """A Qwen3.5-style template (its calls as <function=…><parameter=…>): under tool_choice
    "required" the grammar writes an XML call, and its values come back typed by the parameters'
    schema (the string "123" stays a string, the integer is a number)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "api"))
    from apiserver import MODEL, serve
    from test_hybrid_families import QWEN35_STYLE

    from inferd.engine.config import EngineConfig
    from inferd.engine.llm_engine import LLMEngine

    # (a byte-level vocabulary, as Qwen's: SentencePiece's leading-space piece meets grammars badly)
    folder = write_tiny_qwen35(tmp_path / "qwen35", byte_level=True)
    parameters = {"type": "object", "properties": {"city": {"type": "string", "enum": ["123"]},
                                                   "days": {"type": "integer", "enum": [2]}},
                  "required": ["city", "days"]}

    written = json.loads((folder / "tokenizer_config.json").read_text())
    without_eos = {key: value for key, value in written.items() if key != "eos_token"}

    async def forced_call(tokenizer_config: dict[str, Any]) -> Any:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"chat_template": QWEN35_STYLE}))
        engine = LLMEngine.from_config(EngineConfig.of(model=str(folder), dtype="float32",
                                                       kv_cache_memory=16 * 2**20))
        async with serve(engine) as server:
            client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused",
                                        max_retries=0)
            return await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=200, temperature=0,
                tools=[{"type": "function", "function": {"name": "weather", "parameters": parameters}}],
                tool_choice="required", extra_body={"chat_template_kwargs": {"enable_thinking": False}})

    with pytest.raises(openai.BadRequestError, match="no end-of-sequence token"):  # (a grammar ends on EOS)
        await forced_call(without_eos)
    chat = await forced_call(written)
    [call] = chat.choices[0].message.tool_calls or []
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "123", "days": 2}
    assert chat.choices[0].finish_reason == "tool_calls"
