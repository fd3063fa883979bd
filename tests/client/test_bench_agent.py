"""`inferd bench --workload agent`: the sessions' content (reproducible by seed, one system prompt
with the tools' JSON schemas shared, copy turns that ask for a file of the context back), the
options refused, the usage fields read (OpenAI's cached tokens, inferd's `speculative`, llama-server's
`timings`), the summary's split and report, and a whole run against a real aiohttp chat server on a
real socket, whose requests must chain: each turn's messages the last turn's plus its streamed
answer and the next tool result."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from rich.console import Console
from typer.testing import CliRunner

from inferd.cli import app
from inferd.client.bench import BenchConfig, BenchError, run
from inferd.client.bench_agent import (
    COPY_TURNS, TURNS, AgentShape, AgentWorkload, render_agent, summarize_agent,
)
from inferd.client.bench_conversation import MAX_CONTEXT
from inferd.client.bench_http import send
from inferd.client.bench_metrics import RequestRecord

CODE = re.compile(r"```python\n(.*?)```", re.S)


def text_of(renderable: Any) -> str:
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# ------------------------------------------------------------------------------------ content


def test_sessions_are_reproducible_and_share_only_the_system_prompt() -> None:
    workload = AgentWorkload(seed=1)
    assert AgentWorkload(seed=1).conversation(5) == workload.conversation(5)
    assert AgentWorkload(seed=2).conversation(5) != workload.conversation(5)
    assert workload.conversation(5, "warmup") != workload.conversation(5)
    assert AgentWorkload(seed=1).system == workload.system != AgentWorkload(seed=2).system
    sessions = [workload.conversation(k) for k in range(20)]
    assert all(s.turns == TURNS and len(s.tools) == TURNS - 1 for s in sessions)
    assert len({s.task.split(":")[0] for s in sessions}) == len(sessions)  # each its own tag, first thing
    assert len({s.tools[0] for s in sessions}) == len(sessions)  # and its own files


def test_the_system_prompt_carries_every_tool_as_a_json_function() -> None:
    system = AgentWorkload().system
    tools = [json.loads(line) for line in system.splitlines() if line.startswith('{"type": "function"')]
    names = [t["function"]["name"] for t in tools]
    assert names == ["read_file", "write_file", "edit_file", "run_command", "search", "list_dir", "git_diff", "finish"]
    assert all(t["function"]["parameters"]["type"] == "object" for t in tools)
    assert 1200 * 3 < len(system) < 1400 * 4.5  # ~1.2k tokens of JSON and prose


def test_copy_turns_ask_for_a_file_of_the_context_back_whole() -> None:
    workload = AgentWorkload(seed=0)
    for k in range(10):
        s = workload.conversation(k)
        file_a, file_b = CODE.search(s.tools[0]), CODE.search(s.tools[2])
        assert file_a and file_b and "run_command" in s.tools[1] and "run_command" in s.tools[3]
        for turn, file in zip(COPY_TURNS, (file_b, file_a)):
            ask = s.tools[turn - 2]  # turn n's user message is tools[n - 2]
            old, new = re.search(r"function `(\w+)` renamed to `(\w+)`", ask).groups()
            assert f"def {old}(" in file.group(1) and "whole file" in ask
            assert new.startswith(old) and f"def {new}(" not in file.group(1)
            # room for the whole file: the tokenizer makes ≥ 3.3 characters a token of this code
            assert len(file.group(1)) / 3.3 < s.answer_tokens[turn - 1] < len(file.group(1)) / 3.0
        assert all(48 <= s.answer_tokens[n - 1] <= 128 for n in range(1, TURNS + 1) if n not in COPY_TURNS)
        assert CODE.search(s.tools[4]) is None  # turn 6 copies turn 2's file, far back in the context


def test_the_shape_fits_the_context_and_a_longer_one_is_refused() -> None:
    assert AgentShape().context() <= MAX_CONTEXT
    with pytest.raises(ValueError, match="over 7,936: shorten"):
        AgentWorkload(AgentShape(file_tokens=(1500, 2000)))
    with pytest.raises(ValueError, match="file tokens need 1 ≤ MIN ≤ MAX"):
        AgentShape(file_tokens=(900, 500)).check()


def test_config_and_cli_refuse_what_a_session_cannot_take() -> None:
    BenchConfig("u", workload="agent").check()
    for bad, message in ((dict(rates=(2.0,)), "--workload agent is a closed loop"),
                         (dict(dataset="d.jsonl"), "drop --dataset"),
                         (dict(priority_mix="a=1"), "drop --priority-mix")):
        with pytest.raises(BenchError, match=re.escape(message)):  # before anything is sent
            run(BenchConfig("http://127.0.0.1:1", workload="agent", **bad), out=Console(file=io.StringIO()))
    d = BenchConfig("u", workload="agent").to_json()
    assert d["workload"] == "agent" and not {"turns", "system_tokens", "tool_tokens"} & set(d)
    result = CliRunner().invoke(app, ["bench", "http://127.0.0.1:1", "--workload", "agent", "--rate", "2"])
    assert result.exit_code == 1 and "closed loop" in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------------------------ usage


@pytest.mark.asyncio
async def test_send_reads_cached_and_speculative_tokens_from_usage_or_timings(serve: Any) -> None:
    finals = [  # (the last event's extra fields, the record's cached / drafted / accepted)
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4},
                    "speculative": {"drafted_tokens": 12, "accepted_tokens": 7}}}, (4, 12, 7)),
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}},
         (0, None, None)),  # nothing drafted: inferd leaves `speculative` out
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 2},  # llama-server: its timings
          "timings": {"cache_n": 5, "draft_n": 10, "draft_n_accepted": 3}}, (5, 10, 3)),
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 2}}, (None, None, None)),
    ]
    application = web.Application()

    async def handler(request: web.Request) -> web.StreamResponse:
        final = finals[int(request.query["n"])][0]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in ({"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]},
                      {"choices": [], **final}):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    application.router.add_post("/v1/completions", handler)
    root = await serve(application)
    async with aiohttp.ClientSession() as session:
        for n, (_, expected) in enumerate(finals):
            record = await send(session, f"{root}/v1/completions?n={n}", {"prompt": "x"}, RequestRecord(index=n),
                                api_key=None, t0=0.0)
            assert record.ok and (record.cached_tokens, record.drafted_tokens, record.accepted_tokens) == expected
            d = record.to_json()
            assert {k: d.get(k) for k in ("cached_tokens", "drafted_tokens", "accepted_tokens")} == dict(
                zip(("cached_tokens", "drafted_tokens", "accepted_tokens"), expected))
            assert RequestRecord.from_json(json.loads(json.dumps(d))).cached_tokens == expected[0]


# ------------------------------------------------------------------------------------ summary


def turn_record(index: int, turn: int, ttft: float, out: int, cached: int | None = None,
                drafted: int | None = None, accepted: int | None = None, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=index, ttft=ttft, itl=[0.01] * (out - 1), e2e=ttft + 0.01 * (out - 1),
                         output_tokens=out, chunks=out, status=200, prompt_tokens=1000, token_source="usage",
                         turn=turn, conversation=0, cached_tokens=cached, drafted_tokens=drafted,
                         accepted_tokens=accepted, error_type=None if ok else "incomplete_stream")


def test_summary_splits_copy_turns_and_sums_cache_and_drafts() -> None:
    records = [turn_record(0, 1, 0.9, 11, cached=0), turn_record(1, 2, 0.3, 11, cached=800),
               turn_record(2, 3, 0.4, 21, cached=900, drafted=10, accepted=2),
               turn_record(3, 4, 0.5, 101, cached=950, drafted=120, accepted=90),
               turn_record(4, 5, 0.2, 11, cached=None),
               turn_record(5, 6, 0.7, 201, cached=990, drafted=80, accepted=70),
               turn_record(6, 6, 9.0, 5, cached=1000, drafted=1000, accepted=0, ok=False)]  # failed: not counted
    s = summarize_agent(records)
    assert s["ttft_first_turn"]["p50"] == pytest.approx(0.9)
    assert s["ttft_later_turns"]["p50"] == pytest.approx(0.4)  # 0.3, 0.4, 0.5, 0.2, 0.7
    assert s["ttft_copy_turns"]["p50"] == pytest.approx(0.6) and s["ttft_tool_turns"]["p50"] == pytest.approx(0.3)
    assert s["decode_tok_s_copy_turns"]["p50"] == pytest.approx(100.0)  # one token every 10 ms
    assert s["output_tokens_copy_turns"] == 302
    assert s["cached_tokens"] == {"requests": 5, "cached": 3640, "prompt": 5000, "fraction": pytest.approx(0.728)}
    spec = s["speculation"]
    assert (spec["drafted_tokens"], spec["accepted_tokens"], spec["requests"]) == (210, 162, 3)
    assert spec["acceptance"] == pytest.approx(162 / 210)
    assert (spec["copy_turns"]["drafted_tokens"], spec["other_turns"]["accepted_tokens"]) == (200, 2)
    assert s["conversations"]["finished"] == 1 and s["copy_turns"] == [4, 6]
    text = text_of(render_agent(s))
    assert "cached prompt tokens: 3,640 of 5,000 (72.8%) over 5 requests" in text
    assert "accepted / drafted 162 / 210 (77.1%; copy turns 160 / 200, others 2 / 10)" in text
    assert "copy turns 600.0 / " in text
    bare = summarize_agent([turn_record(0, 1, 0.5, 3)])
    assert bare["speculation"] is None and "speculation: not reported" in text_of(render_agent(bare))


# ------------------------------------------------------------------------------------ a run

BODIES = web.AppKey("bodies", list)  # every request's JSON body, in arrival order
ANSWERS = web.AppKey("answers", list)  # the text streamed back for each, same order


def agent_server() -> web.Application:
    """A streaming chat server: max_tokens chunks of a text unique to the request, then usage with
    cached tokens (the words of every message but the last) and, for answers over 200 tokens,
    drafts (half of them accepted), then [DONE]."""
    application = web.Application()
    application[BODIES], application[ANSWERS] = [], []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(request.app[BODIES])
        pieces = [f" a{n}.{k}" for k in range(body["max_tokens"])]
        request.app[BODIES].append(body)
        request.app[ANSWERS].append("".join(pieces))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        words = [len(m["content"].split()) for m in body["messages"]]
        usage: dict[str, Any] = {"prompt_tokens": sum(words), "completion_tokens": len(pieces),
                                 "prompt_tokens_details": {"cached_tokens": sum(words[:-1])}}
        if len(pieces) > 200:
            usage["speculative"] = {"drafted_tokens": len(pieces), "accepted_tokens": len(pieces) // 2}
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  *({"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces),
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, {"choices": [], "usage": usage}]
        await response.write("".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n")
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    application.router.add_post("/v1/chat/completions", chat)
    application.router.add_get("/v1/models", models)
    return application


@pytest.mark.asyncio
async def test_a_run_chains_each_session_and_reports_copy_turns(serve: Any, tmp_path: Path) -> None:
    server = agent_server()
    root = await serve(server)
    path = tmp_path / "agent.json"
    config = BenchConfig(root, workload="agent", concurrency=2, num_requests=14, warmup=1, ignore_eos=True, seed=3,
                         json_path=str(path))
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    result = await asyncio.to_thread(run, config, console, Console(file=io.StringIO()))
    bodies, answers = server[BODIES], server[ANSWERS]
    workload = AgentWorkload(seed=3)
    assert len(bodies) == 15  # a warm-up first turn, then 14
    assert bodies[0]["messages"][1]["content"] == workload.conversation(0, "warmup").task
    assert all(b["stream"] and b["temperature"] == 0 and b["ignore_eos"] and b["model"] == "stub" for b in bodies)
    assert all(b["messages"][0] == {"role": "system", "content": workload.system} for b in bodies)

    [run_] = result["runs"]
    records = run_["requests"]
    by_task: dict[str, list[int]] = {}
    for n, body in enumerate(bodies[1:], 1):
        by_task.setdefault(body["messages"][1]["content"], []).append(n)
    for k in sorted({r["conversation"] for r in records}):
        expected = workload.conversation(k, "point0")  # a pure function of (seed, stream, index)
        sent = sorted(by_task.pop(expected.task), key=lambda n: len(bodies[n]["messages"]))
        for turn, n in enumerate(sent, 1):
            assert bodies[n]["max_tokens"] == expected.answer_tokens[turn - 1]
            if turn > 1:  # the last turn's messages, the answer it streamed back, the next tool result
                previous = sent[turn - 2]
                assert bodies[n]["messages"] == [*bodies[previous]["messages"],
                                                 {"role": "assistant", "content": answers[previous]},
                                                 {"role": "user", "content": expected.tools[turn - 2]}]
    assert not by_task  # every request belongs to a recorded session

    s = run_["summary"]
    copies = [r for r in records if r["turn"] in COPY_TURNS]
    assert s["completed"] == 14 and s["conversations"]["started"] in (3, 4) and s["conversations"]["finished"] == 2
    assert len(copies) == 4 and s["output_tokens_copy_turns"] == sum(r["output_tokens"] for r in copies)
    assert all(r["drafted_tokens"] == r["output_tokens"] for r in copies)  # the stub drafts on copy turns only
    assert s["speculation"]["copy_turns"]["drafted_tokens"] == s["speculation"]["drafted_tokens"]
    assert s["speculation"]["acceptance"] == pytest.approx(0.5, abs=0.01)
    assert s["cached_tokens"]["requests"] == 14 and 0.5 < s["cached_tokens"]["fraction"] < 1
    data = json.loads(path.read_text())
    assert data["config"]["workload"] == "agent" and data["config"]["endpoint"] == "chat"
    assert data["runs"][0]["summary"]["ttft_copy_turns"]["p99"] == s["ttft_copy_turns"]["p99"]
    text = console.export_text()
    assert "agent sessions of 6 turns, chat" in text and "TTFT turns 2+" in text
    assert "agent  speculation: accepted / drafted" in text and "agent  cached prompt tokens:" in text
