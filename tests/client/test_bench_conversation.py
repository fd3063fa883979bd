"""`inferd bench --workload conversation`: the conversations' content (reproducible by seed, one
system prompt shared, nothing else shared), the options refused, the first/later-turn split of the
summary and its report, and a whole run against a real aiohttp chat server on a real socket, whose
requests must chain: each turn's messages the last turn's plus its streamed answer and a tool result."""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from rich.console import Console
from typer.testing import CliRunner

from inferd.cli import app, bench_run
from inferd.client.bench import BenchConfig, BenchError, run
from inferd.client.bench_conversation import (
    DEFAULT_ANSWER_TOKENS, DEFAULT_SYSTEM_TOKENS, DEFAULT_TOOL_TOKENS, DEFAULT_TURNS, MAX_CONTEXT, ConversationShape,
    ConversationWorkload, parse_range, summarize_turns,
)
from inferd.client.bench_metrics import RequestRecord, summarize
from inferd.client.bench_report import render_run, render_sweep

SMALL = ConversationShape(turns=3, system_tokens=40, tool_tokens=(5, 12), answer_tokens=(2, 4))


def text_of(renderable: Any) -> str:
    console = Console(record=True, width=160, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# ------------------------------------------------------------------------------------ content


def test_conversations_are_reproducible_and_share_only_the_system_prompt() -> None:
    workload = ConversationWorkload(ConversationShape(), seed=1)
    assert ConversationWorkload(ConversationShape(), seed=1).conversation(5) == workload.conversation(5)
    assert ConversationWorkload(ConversationShape(), seed=2).conversation(5) != workload.conversation(5)
    assert workload.conversation(5, "warmup") != workload.conversation(5)
    assert ConversationWorkload(SMALL, seed=1).system != ConversationWorkload(SMALL, seed=2).system
    assert len(workload.system.split()) == round(1250 * 0.75)
    conversations = [workload.conversation(k) for k in range(40)]
    for c in conversations:
        assert c.turns == 7 and len(c.tools) == 6 and len(c.task.split()) == 2 + round(200 * 0.75)
        assert all(64 <= n <= 200 for n in c.answer_tokens)
        assert all(round(300 * 0.75) <= len(t.split()) - 3 <= round(800 * 0.75) for t in c.tools)
    # every conversation's own text differs from the others' from its first words on
    assert len({c.task.split()[1] for c in conversations}) == len(conversations)
    firsts = [workload.messages(c, []) for c in conversations]
    assert all(m[0] == {"role": "system", "content": workload.system} for m in firsts)
    assert len({m[1]["content"][:20] for m in firsts}) == len(conversations)


def test_each_turn_is_the_last_one_plus_its_answer_and_a_tool_result() -> None:
    workload = ConversationWorkload(SMALL, seed=0)
    c = workload.conversation(0)
    answers = ["first answer", "second answer"]
    specs = [workload.spec(c, answers[:n]) for n in range(3)]
    assert [len(s.messages or []) for s in specs] == [2, 4, 6]
    assert [s.max_tokens for s in specs] == list(c.answer_tokens)
    for n in (1, 2):
        before, after = specs[n - 1].messages, specs[n].messages
        assert before is not None and after is not None
        assert after == [*before, {"role": "assistant", "content": answers[n - 1]},
                         {"role": "user", "content": c.tools[n - 1]}]
    with pytest.raises(IndexError):
        workload.spec(c, [*answers, "third"])  # three turns: no fourth


# ------------------------------------------------------------------------------------ options


def test_the_defaults_fit_the_context_and_a_turn_more_does_not() -> None:
    shape = ConversationShape()
    shape.check()
    assert shape.context(7) == 1250 + 200 + 6 * (800 + 200) + 200 <= MAX_CONTEXT < shape.context(8)
    with pytest.raises(ValueError, match=r"--turns 8 .* reach 8,650 tokens .* over 7,936 .* use --turns 7 or fewer"):
        ConversationShape(turns=8).check()
    with pytest.raises(ValueError, match="shorten the lengths"):
        ConversationShape(system_tokens=8000).check()
    ConversationShape(turns=12, tool_tokens=(100, 300), answer_tokens=(32, 64)).check()


def test_parse_range() -> None:
    assert parse_range("300-800", "--tool-tokens") == (300, 800) and parse_range(" 64 ", "--x") == (64, 64)
    for bad in ("800-300", "a-b", "0-5", "-5", "", "3-"):
        with pytest.raises(ValueError, match="--tool-tokens"):
            parse_range(bad, "--tool-tokens")


def test_config_refuses_what_a_conversation_cannot_take() -> None:
    conversation = dict(workload="conversation", turns=3, system_tokens=40, tool_tokens=(5, 12), answer_tokens=(2, 4))
    BenchConfig("u", **conversation).check()
    for bad, message in ((dict(workload="chat"), "--workload is one of requests, conversation"),
                         (dict(conversation, rates=(2.0,)), "not --rate"),
                         (dict(conversation, dataset="d.jsonl"), "drop --dataset"),
                         (dict(conversation, priority_mix="a=1"), "drop --priority-mix"),
                         (dict(conversation, turns=0), "--turns must be ≥ 1"),
                         (dict(conversation, answer_tokens=(5, 2)), "--answer-tokens"),
                         (dict(workload="conversation", turns=20), "use --turns 7 or fewer")):
        with pytest.raises(ValueError, match=re.escape(message)):
            BenchConfig("u", **bad).check()
        with pytest.raises(BenchError, match=re.escape(message)):  # before anything is sent
            run(BenchConfig("http://127.0.0.1:1", **bad), out=Console(file=io.StringIO()))
    # the requests workload's JSON as it was; the conversation's options where they count
    assert not {"workload", "turns", "tool_tokens"} & set(BenchConfig("u").to_json())
    d = BenchConfig("u", **conversation).to_json()
    assert d["workload"] == "conversation" and d["tool_tokens"] == [5, 12] and d["turns"] == 3


def test_cli_options_and_their_errors() -> None:
    defaults = {name: p.default for name, p in inspect.signature(bench_run).parameters.items()}
    assert defaults["workload"] == "requests" and defaults["turns"] == DEFAULT_TURNS
    assert defaults["system_tokens"] == DEFAULT_SYSTEM_TOKENS
    assert parse_range(defaults["tool_tokens"], "") == DEFAULT_TOOL_TOKENS
    assert parse_range(defaults["answer_tokens"], "") == DEFAULT_ANSWER_TOKENS
    runner = CliRunner()
    too_long = runner.invoke(app, ["bench", "http://127.0.0.1:1", "--workload", "conversation", "--turns", "8"])
    assert too_long.exit_code == 1 and "use --turns 7 or fewer" in too_long.output
    assert "Traceback" not in too_long.output
    bad_range = runner.invoke(app, ["bench", "http://127.0.0.1:1", "--workload", "conversation",
                                    "--tool-tokens", "800-300"])
    assert bad_range.exit_code == 1 and "--tool-tokens needs 1 ≤ MIN ≤ MAX" in bad_range.output
    rate = runner.invoke(app, ["bench", "http://127.0.0.1:1", "--workload", "conversation", "--rate", "2"])
    assert rate.exit_code == 1 and "closed loop" in rate.output


# ------------------------------------------------------------------------------------ summary


def turn_record(index: int, conversation: int, turn: int, ttft: float, prompt: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=index, ttft=ttft, itl=[0.01], e2e=ttft + 0.01, output_tokens=2, chunks=2, status=200,
                         prompt_tokens=prompt, token_source="usage", turn=turn, conversation=conversation,
                         error_type=None if ok else "incomplete_stream")


def test_summary_splits_first_and_later_turns() -> None:
    records = [turn_record(0, 0, 1, 0.5, 100), turn_record(1, 1, 1, 0.7, 100), turn_record(2, 0, 2, 0.1, 300),
               turn_record(3, 1, 2, 0.2, 340), turn_record(4, 0, 3, 0.3, 500), turn_record(5, 1, 3, 9.0, 900, ok=False)]
    s = summarize(records, duration=2.0) | summarize_turns(records, turns=3)
    assert s["ttft_first_turn"]["p50"] == pytest.approx(0.6) and s["ttft_first_turn"]["p90"] == pytest.approx(0.68)
    assert s["ttft_later_turns"]["p50"] == pytest.approx(0.2) and s["ttft_later_turns"]["p99"] == pytest.approx(0.298)
    assert s["prompt_tokens_later_turns_mean"] == pytest.approx(380)  # 300, 340, 500: the failed one not counted
    assert s["conversations"] == {"turns": 3, "started": 2, "finished": 1, "first_turns": 2, "later_turns": 3}
    assert s["output_throughput"] == pytest.approx(5.0)
    again = RequestRecord.from_json(json.loads(json.dumps(records[3].to_json())))
    assert (again.turn, again.conversation) == (2, 1)
    run_ = {"label": "concurrency=2", "summary": s, "server_counters": None}
    text = text_of(render_run(run_))
    assert "2 started, 1 finished (3 turns each); 2 first turns, 3 later turns of 380 prompt tokens" in text
    assert re.search(r"TTFT turn 1\s+600\.0\s+600\.0\s+680\.0", text)
    assert re.search(r"TTFT turns 2\+\s+200\.0\s+200\.0", text)
    sweep = text_of(render_sweep({"runs": [run_, {**run_, "label": "concurrency=8"}]}))
    assert "TTFT1 p90" in sweep and "TTFT2+ p99" in sweep
    assert re.search(r"concurrency=8\s+5\.0\s+600\.0\s+680\.0\s+698\.0\s+200\.0", sweep)


# ------------------------------------------------------------------------------------ a run

BODIES = web.AppKey("bodies", list)  # every request's JSON body, in arrival order
ANSWERS = web.AppKey("answers", list)  # the text streamed back for each, same order
FIRST_TURN_DELAY = 0.2  # seconds before a first turn's first token (a later turn's: none)


def chat_server() -> web.Application:
    """A streaming chat server: max_tokens chunks of a text unique to the request, after a role
    header, then a finish chunk, usage (prompt tokens: the words sent) and [DONE]."""
    application = web.Application()
    application[BODIES], application[ANSWERS] = [], []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(request.app[BODIES])
        pieces = [f" a{n}.{k}" for k in range(body["max_tokens"])]
        request.app[BODIES].append(body)
        request.app[ANSWERS].append("".join(pieces))
        await asyncio.sleep(FIRST_TURN_DELAY if len(body["messages"]) == 2 else 0.0)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        words = sum(len(m["content"].split()) for m in body["messages"])
        deltas = [{"role": "assistant", "content": ""}, *({"content": p} for p in pieces)]
        for delta in deltas:
            await response.write(f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n".encode())
        events = [{"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": words, "completion_tokens": len(pieces)}}]
        for event in events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    application.router.add_post("/v1/chat/completions", chat)
    application.router.add_get("/v1/models", models)
    return application


@pytest.mark.asyncio
async def test_a_run_chains_each_conversation_and_splits_the_ttfts(serve: Any, tmp_path: Path) -> None:
    server = chat_server()
    root = await serve(server)
    path = tmp_path / "conversation.json"
    config = BenchConfig(root, workload="conversation", concurrency=2, num_requests=10, warmup=2, turns=3,
                         system_tokens=40, tool_tokens=(5, 12), answer_tokens=(2, 4), ignore_eos=True, seed=3,
                         json_path=str(path))
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    result = await asyncio.to_thread(run, config, console, Console(file=io.StringIO()))
    bodies, answers = server[BODIES], server[ANSWERS]
    workload = ConversationWorkload(SMALL, seed=3)
    assert len(bodies) == 12  # 2 warm-up first turns, then 10
    assert all(b["stream"] and b["temperature"] == 0 and b["ignore_eos"] and b["model"] == "stub" for b in bodies)
    assert all(b["messages"][0] == {"role": "system", "content": workload.system} for b in bodies)
    assert {b["messages"][1]["content"] for b in bodies[:2]} == {workload.conversation(k, "warmup").task for k in (0, 1)}

    [run_] = result["runs"]
    records = run_["requests"]
    assert [r["index"] for r in records] == list(range(10))
    by_task = {}
    for n, body in enumerate(bodies[2:], 2):
        by_task.setdefault(body["messages"][1]["content"], []).append(n)
    for k in sorted({r["conversation"] for r in records}):
        expected = workload.conversation(k, "point0")  # a pure function of (seed, stream, index)
        sent = sorted(by_task.pop(expected.task), key=lambda n: len(bodies[n]["messages"]))
        turns = sorted(r["turn"] for r in records if r["conversation"] == k)
        assert turns == list(range(1, len(sent) + 1))
        for turn, n in enumerate(sent, 1):
            assert bodies[n]["max_tokens"] == expected.answer_tokens[turn - 1]
            if turn > 1:  # the last turn's messages, the answer it streamed back, a new tool result
                previous = sent[turn - 2]
                assert bodies[n]["messages"] == [*bodies[previous]["messages"],
                                                 {"role": "assistant", "content": answers[previous]},
                                                 {"role": "user", "content": expected.tools[turn - 2]}]
    assert not by_task  # every request belongs to a recorded conversation

    s = run_["summary"]
    assert s["completed"] == 10 and s["conversations"]["started"] == 4
    assert s["conversations"]["first_turns"] + s["conversations"]["later_turns"] == 10
    assert s["ttft_first_turn"]["p50"] >= FIRST_TURN_DELAY > s["ttft_later_turns"]["p50"]
    later = [r["prompt_tokens"] for r in records if r["turn"] > 1]
    assert s["prompt_tokens_later_turns_mean"] == pytest.approx(sum(later) / len(later))
    assert s["tpot"]["p50"] is not None and s["output_tokens"] == sum(b["max_tokens"] for b in bodies[2:])
    data = json.loads(path.read_text())
    assert data["config"]["workload"] == "conversation" and data["config"]["endpoint"] == "chat"
    assert data["runs"][0]["summary"]["ttft_later_turns"]["p99"] == s["ttft_later_turns"]["p99"]
    text = console.export_text()
    assert "conversations of 3 turns, chat" in text and "4 started" in text
    assert "TTFT turn 1" in text and "TTFT turns 2+" in text
