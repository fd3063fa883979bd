"""Output processing over a real socket: the blocklist ([output_filter], mask and stop) on a word
the model really writes, split across tokens; and `"segment"` streaming in whole sentences and
lines, whose text is token mode's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from apiserver import MODEL, Server, assert_error, data_events, serve

from inferd.api.openai.chat import chat_prompt
from inferd.api.openai.chat_wire import ChatMessage
from inferd.settings.config import Settings
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.text.sampling_params import SamplingParams

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

# (endpoint, body, max_tokens): greedy requests whose text has sentences (and newlines), and
# words the tokenizer splits ("Mona": " Mon" + "a")
COMPLETION = ("/v1/completions", {"prompt": "The Mona Lisa was painted by"}, 32)
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Who painted the Mona Lisa? Answer in two sentences."}]}, 32)
CHAT_SENTENCES = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about cats in three sentences."}]}, 32)
COMPLETION_LINES = ("/v1/completions", {"prompt": "My favourite animals:\n1."}, 16)
CHAT_LINES = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "List three fruits, one per line."}]}, 16)
Case = tuple[str, dict[str, Any], int]
SENTENCE_END = re.compile(r"[.!?。！？\n][\"'”’)\]]*\s*\Z")


@pytest.fixture(scope="module")
def token_texts(served_weights: tuple) -> dict[str, str]:
    """Each case's greedy text in token mode (the engine offline: the same tokens as served)."""
    llm = LLMEngine(*served_weights, EngineConfig())
    texts = {}
    for path, body, max_tokens in (COMPLETION, CHAT, CHAT_SENTENCES, COMPLETION_LINES, CHAT_LINES):
        prompt = body["prompt"] if "prompt" in body else chat_prompt(
            llm.tokenizer, [ChatMessage.model_validate(m) for m in body["messages"]], None)
        texts[str(body)] = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text
    return texts


def multi_token_word(llm: LLMEngine, text: str) -> str:
    """A word of `text` that the tokenizer splits into two tokens or more."""
    for word in re.findall(r"[A-Za-z]{4,}", text):
        if len(llm.tokenizer.encode(" " + word, add_special_tokens=False)) >= 2:
            return word
    raise AssertionError(f"no multi-token word in {text!r}")


async def stream(server: Server, case: Case, **fields: Any) -> tuple[list[str], str | None]:
    """The text of every event of a streamed greedy request (the role chunk aside), and how it ended."""
    path, body, max_tokens = case
    response, events = await server.stream(path, {"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
                                                  **body, **fields})
    assert response.status == 200
    deltas, finish = [], None
    for chunk in data_events(events):
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        delta = choice.get("delta", {})
        if delta.get("role") == "assistant":
            continue
        deltas.append(choice["text"] if "text" in choice else delta.get("content", ""))
        finish = choice["finish_reason"] or finish
    return deltas, finish


def masked(text: str, terms: list[str]) -> str:
    chars = list(text)
    for term in terms:
        for m in re.finditer(re.escape(term), text, re.IGNORECASE):
            chars[m.start():m.end()] = "*" * len(term)
    return "".join(chars)


@pytest.mark.parametrize("action", ["mask", "stop"])
async def test_blocked_words_never_reach_the_client(llm: LLMEngine, token_texts: dict[str, str], tmp_path: Path,
                                                    action: str) -> None:
    terms = [multi_token_word(llm, token_texts[str(case[1])]) for case in (COMPLETION, CHAT)]
    blocklist = tmp_path / "blocklist.txt"
    blocklist.write_text("# words the model writes\n" + "\n".join(t.upper() for t in terms) + "\n")
    settings = Settings.model_validate({"output_filter": {"blocklist_file": str(blocklist), "action": action}})
    config = dataclasses.replace(llm.config, output_filter=EngineConfig.from_settings(settings).output_filter)
    filtered = LLMEngine(llm.model, llm.tokenizer, config)
    streamed: dict[str, str] = {}
    async with serve(filtered, settings) as server:
        for case in (COMPLETION, CHAT):
            text = token_texts[str(case[1])]
            deltas, finish = await stream(server, case)
            prefixes = ["".join(deltas[:i]) for i in range(1, len(deltas) + 1)]
            streamed[str(case[1])] = prefixes[-1]
            assert not any(t.lower() in p.lower() for t in terms for p in prefixes), deltas
            if action == "mask":
                assert prefixes[-1] == masked(text, terms) and finish in ("stop", "length")
            else:
                cut = min(m.start() for t in terms for m in re.finditer(re.escape(t), text, re.IGNORECASE))
                assert prefixes[-1] == text[:cut] and finish == "content_filter"
        path, body, max_tokens = COMPLETION  # not streamed: the same text, the same ending
        status, reply = await server.post(path, {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, **body})
        assert status == 200 and reply["choices"][0]["text"] == streamed[str(body)]
        assert reply["choices"][0]["finish_reason"] == ("content_filter" if action == "stop" else "length")
        # logprobs' token strings come from token ids, around the filter: refused, not leaked
        status, reply = await server.post(path, {"model": MODEL, "max_tokens": 4, "logprobs": 1, **body})
        assert_error(status, reply, 400, param="logprobs")


async def test_sentences_and_lines(llm: LLMEngine, token_texts: dict[str, str]) -> None:
    async with serve(llm) as server:
        for case, segment in ((COMPLETION, "sentence"), (CHAT_SENTENCES, "sentence"), (COMPLETION_LINES, "line"),
                              (CHAT_LINES, "line")):
            text = token_texts[str(case[1])]
            deltas, finish = await stream(server, case, segment=segment)
            assert "".join(deltas) == text and finish in ("stop", "length"), (segment, deltas)
            assert len(deltas) < case[2] and all(deltas[:-1]), deltas  # no empty deltas but the finish
            whole = deltas[:-1] if deltas[-1] else deltas[:-2]  # (the last text is what the end flushed)
            assert whole, deltas
            for delta in whole:
                assert (SENTENCE_END if segment == "sentence" else re.compile(r"\n\Z")).search(delta), deltas
        status, body = await server.post("/v1/completions", {"model": MODEL, "prompt": "x", "segment": "word"})
        assert_error(status, body, 400)
