"""`inferd bench`'s pure parts against hand-computed values, its workload and schedule, the
report, compare and plot, and the streamed request against in-process stub servers (no engine)."""

from __future__ import annotations

import io
import json
import re
import statistics
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from rich.console import Console
from typer.testing import CliRunner

from inferd.cli import app
from inferd.client.bench import BenchConfig, BenchError, compare, parse_list
from inferd.client.bench_http import (
    _token_text, counter_deltas, list_models, parse_counters, request_body, root_url, send,
)
from inferd.client.bench_metrics import RequestRecord, goodput, meets_slo, parse_slo, percentile, summarize
from inferd.client.bench_report import DPI, SINGLE_SIZE, SWEEP_SIZE, make_figure, render_run, write_plot
from inferd.client.bench_workload import (
    WORDS, RequestSpec, Workload, arrival_times, load_dataset, parse_mix, sample_length, synthetic_prompt,
)


def text_of(renderable: Any, width: int = 120) -> str:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def rec(index: int, ttft: float | None, itl: list[float], out: int, **kw: Any) -> RequestRecord:
    e2e = None if ttft is None else ttft + sum(itl)
    return RequestRecord(index=index, ttft=ttft, itl=itl, e2e=e2e, elapsed=e2e or 0.0, output_tokens=out,
                         chunks=len(itl) + (ttft is not None), token_source="usage", status=200, **kw)


# Five requests over a 2-second run. Completed: r0 (4 tokens), r1 (2), r2 (1: no TPOT);
# failed: r3 (a stream cut short), r4 (refused at the door).
RECORDS = [
    rec(0, 0.1, [0.02, 0.03, 0.05], 4, prompt_tokens=10, priority="interactive", send_time=0.0),
    rec(1, 0.3, [0.1], 2, prompt_tokens=20, priority="batch", send_time=0.5),
    rec(2, 0.2, [], 1, prompt_tokens=30, priority="interactive", send_time=1.0),
    rec(3, 0.1, [0.05], 2, priority="batch", send_time=1.2, error_type="incomplete_stream", error="cut"),
    RequestRecord(index=4, priority="batch", send_time=1.5, elapsed=0.01, status=429, error_type="queue_full",
                  error="HTTP 429: full"),
]


# ------------------------------------------------------------------------------------ metrics


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    rng = np.random.default_rng(0)
    for n in (2, 5, 17, 100):
        values = rng.lognormal(size=n).tolist()
        for q in (1, 25, 50, 90, 95, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_excludes_the_first_token() -> None:
    r0, r1, r2, r3, _ = RECORDS
    assert r0.tpot == pytest.approx((0.2 - 0.1) / 3)  # e2e 0.2, TTFT 0.1, 4 tokens: 3 gaps
    assert r1.tpot == pytest.approx(0.1)
    assert r2.tpot is None  # one token: no TPOT
    assert r3.tpot is None  # failed


def test_summarize_hand_computed() -> None:
    s = summarize(RECORDS, duration=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["input_tokens"] == 60 and s["input_throughput"] == pytest.approx(30.0)
    assert s["output_tokens"] == 7 and s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(33.5)
    assert s["token_source"] == "usage"
    # TTFT over completed requests: [0.1, 0.3, 0.2]
    assert s["ttft"]["mean"] == pytest.approx(0.2) and s["ttft"]["p50"] == pytest.approx(0.2)
    assert s["ttft"]["p90"] == pytest.approx(0.28) and s["ttft"]["p99"] == pytest.approx(0.298)
    assert s["ttft"]["max"] == pytest.approx(0.3)
    # TPOT: [0.0333.., 0.1]
    assert s["tpot"]["mean"] == pytest.approx((0.1 / 3 + 0.1) / 2)
    # ITL pooled over completed requests: [0.02, 0.03, 0.05, 0.1]
    assert s["itl"]["mean"] == pytest.approx(0.05) and s["itl"]["p50"] == pytest.approx(0.04)
    assert s["itl"]["p90"] == pytest.approx(0.085)
    # e2e: [0.2, 0.4, 0.2]
    assert s["e2e"]["mean"] == pytest.approx(0.8 / 3) and s["e2e"]["p50"] == pytest.approx(0.2)
    assert s["errors"]["total"] == 2
    assert s["errors"]["by_type"] == {"incomplete_stream": 1, "queue_full": 1}
    assert s["errors"]["by_status"] == {"200": 1, "429": 1}
    assert s["errors"]["examples"]["queue_full"] == "HTTP 429: full"
    assert s["goodput"] is None and s["slo"] is None
    # per class, over the same 2 s
    assert set(s["classes"]) == {"interactive", "batch"}
    assert s["classes"]["interactive"]["completed"] == 2 and s["classes"]["interactive"]["output_throughput"] == 2.5
    assert s["classes"]["batch"]["failed"] == 2 and s["classes"]["batch"]["ttft"]["p50"] == pytest.approx(0.3)
    assert "classes" not in s["classes"]["batch"]


def test_goodput_with_slo() -> None:
    slo = parse_slo("ttft=0.25,tpot=0.05")
    assert slo == {"ttft": 0.25, "tpot": 0.05}
    # r0 meets both; r1 misses TTFT (0.3); r2 has one token (TPOT 0) and TTFT 0.2; r3, r4 failed
    assert [meets_slo(r, slo) for r in RECORDS] == [True, False, True, False, False]
    assert goodput(RECORDS, slo, 2.0) == pytest.approx(1.0)
    assert goodput(RECORDS, {"tpot": 0.05}, 2.0) == pytest.approx(1.0)  # r1's TPOT 0.1 misses
    assert goodput(RECORDS, {"e2e": 0.3}, 4.0) == pytest.approx(0.5)
    s = summarize(RECORDS, slo, duration=2.0)
    assert s["goodput"] == pytest.approx(1.0) and s["good_requests"] == 2
    assert s["classes"]["interactive"]["goodput"] == pytest.approx(1.0)


def test_summarize_defaults_and_sources() -> None:
    s = summarize(RECORDS)  # the span: first send 0.0 to the last end, r3 at 1.2 + 0.15
    assert s["duration_s"] == pytest.approx(1.51) and s["request_throughput"] == pytest.approx(3 / 1.51)
    mixed = [rec(0, 0.1, [0.1], 2), rec(1, 0.1, [0.1], 2)]
    mixed[1].token_source = "chunks"
    assert summarize(mixed, duration=1.0)["token_source"] == "mixed"
    empty = summarize([], duration=0.0)
    assert empty["completed"] == 0 and empty["ttft"]["p50"] is None and "classes" not in empty


@pytest.mark.parametrize("bad", ["ttft", "ttft=abc", "latency=1", "tpot=-1", "ttft=0"])
def test_parse_slo_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="--slo"):
        parse_slo(bad)


def test_record_json_round_trip() -> None:
    d = RECORDS[0].to_json()
    assert set(d) >= {"send_time", "ttft", "itl", "e2e", "prompt_tokens", "output_tokens", "status", "error"}
    again = RequestRecord.from_json(json.loads(json.dumps(d)))
    assert again.tpot == pytest.approx(RECORDS[0].tpot)


# ------------------------------------------------------------------------------------ workload


def test_synthetic_prompt_lengths_and_text() -> None:
    import random

    rng = random.Random(0)
    for tokens in (1, 16, 40, 1000):
        words = synthetic_prompt(rng, tokens).split()
        assert len(words) == max(1, round(tokens * 0.75))
        assert all(w in WORDS for w in words)
    assert len(WORDS) > 500  # real prose, long enough that prompts rarely share a start


def test_workload_is_reproducible_with_a_seed() -> None:
    a = [Workload(seed=7, input_len=40, input_dist="uniform").spec(i) for i in range(50)]
    b = [Workload(seed=7, input_len=40, input_dist="uniform").spec(i) for i in reversed(range(50))][::-1]
    c = [Workload(seed=8, input_len=40, input_dist="uniform").spec(i) for i in range(50)]
    assert a == b and a != c
    assert Workload(seed=7).spec(3, "warmup") != Workload(seed=7).spec(3)


def test_length_distributions() -> None:
    import random

    rng = random.Random(1)
    assert {sample_length(rng, 32, "fixed", 0.5) for _ in range(10)} == {32}
    uniform = [sample_length(rng, 40, "uniform", 0.25) for _ in range(2000)]
    assert min(uniform) == 30 and max(uniform) == 50
    lognormal = [sample_length(rng, 100, "lognormal", 0.5) for _ in range(20000)]
    assert statistics.mean(lognormal) == pytest.approx(100, rel=0.03) and min(lognormal) >= 1
    assert max(lognormal) <= 800
    specs = [Workload(seed=0, output_len=8, output_dist="uniform", spread=0.5).spec(i) for i in range(300)]
    assert {s.max_tokens for s in specs} == set(range(4, 13))
    with pytest.raises(ValueError):
        sample_length(rng, 8, "zipf", 0.5)


def test_priority_mix() -> None:
    assert parse_mix("interactive=0.2,batch=0.8") == {"interactive": 0.2, "batch": 0.8}
    assert parse_mix("a=1, b=3") == {"a": 0.25, "b": 0.75}
    for bad in ("a", "a=x", "a=-1", "=1", "a=0"):
        with pytest.raises(ValueError, match="priority-mix"):
            parse_mix(bad)
    w = Workload(seed=0, priority_mix=parse_mix("interactive=0.2,batch=0.8"))
    classes = [w.spec(i).priority for i in range(2000)]
    assert classes.count("interactive") / 2000 == pytest.approx(0.2, abs=0.03)
    assert Workload(seed=0).spec(0).priority is None


def test_chat_specs_and_request_bodies() -> None:
    spec = Workload(seed=0, chat=True, output_len=8).spec(0)
    assert spec.prompt is None and spec.messages is not None and spec.messages[0]["role"] == "user"
    body = request_body(spec, "m", chat=True, ignore_eos=True)
    assert body["messages"] == spec.messages and body["max_tokens"] == 8 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    plain = request_body(RequestSpec(prompt="hi", max_tokens=3, priority="batch"), "m", chat=False, ignore_eos=False)
    assert plain["prompt"] == "hi" and plain["priority"] == "batch" and "ignore_eos" not in plain


def test_arrival_schedule_mean_rate() -> None:
    poisson = arrival_times(5.0, 1.0, seed=0, n=20000)
    gaps = np.diff(poisson)
    assert poisson[0] == 0.0 and len(poisson) == 20000
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_times(5.0, 0.25, seed=0, n=20000))
    assert bursty.mean() == pytest.approx(0.2, rel=0.06)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma: CV = 1/sqrt(shape)
    timed = arrival_times(50.0, seed=3, duration=20.0)
    assert max(timed) < 20.0 and len(timed) == pytest.approx(1000, rel=0.1)
    assert arrival_times(5.0, seed=1, n=10) == arrival_times(5.0, seed=1, n=10) != arrival_times(5.0, seed=2, n=10)
    with pytest.raises(ValueError):
        arrival_times(0.0, n=3)


def test_load_dataset(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "Tell me a story.", "max_tokens": 5}\n\n'
        '{"messages": [{"role": "user", "content": "Hi"}], "priority": "batch"}\n'
    )
    specs = load_dataset(path)
    assert specs == [RequestSpec("Tell me a story.", None, 5, None),
                     RequestSpec(None, [{"role": "user", "content": "Hi"}], None, "batch")]
    chat = Workload(chat=True, output_len=9, dataset=specs)
    assert chat.spec(0) == RequestSpec(None, [{"role": "user", "content": "Tell me a story."}], 5, None)
    assert chat.spec(1).max_tokens == 9 and chat.spec(1).priority == "batch"
    assert chat.spec(2) == chat.spec(0)  # cycled
    with pytest.raises(ValueError, match="request 2 has `messages` but no `prompt`: use --endpoint chat"):
        Workload(chat=False, dataset=specs)
    for bad, message in (('{"prompt": 3}', "prompt"), ("not json", "not JSON"), ("[1]", "JSON object"),
                         ('{"max_tokens": 4}', "needs `prompt`"), ('{"prompt": "x", "max_tokens": 0}', "max_tokens")):
        path.write_text('{"prompt": "ok"}\n' + bad + "\n")
        with pytest.raises(ValueError, match=re.escape(f"{path}:2")) as info:
            load_dataset(path)
        assert message in str(info.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_dataset(tmp_path / "missing.jsonl")


def test_config_points_and_lists() -> None:
    assert parse_list("1,4, 16", int, "--sweep") == (1, 4, 16) and parse_list(None, int, "--sweep") == ()
    with pytest.raises(ValueError, match="--rate"):
        parse_list("1,x", float, "--rate")
    assert [p.label for p in BenchConfig("u", sweep=(1, 4)).points()] == ["concurrency=1", "concurrency=4"]
    rates = BenchConfig("u", rates=(0.5, 2.0), concurrency=8).points()
    assert [(p.label, p.rate, p.concurrency) for p in rates] == [("rate=0.5", 0.5, 8), ("rate=2", 2.0, 8)]
    assert BenchConfig("u").points()[0].concurrency == 1
    with pytest.raises(ValueError, match="--rate"):
        BenchConfig("u", rates=(1.0,), sweep=(2,)).points()
    for bad in (dict(duration=1.0, num_requests=3), dict(endpoint="embeddings"), dict(sweep=(0,))):
        with pytest.raises(ValueError):
            BenchConfig("u", **bad).check()
    assert "api_key" not in BenchConfig("u", api_key="secret").to_json()
    assert "secret" not in repr(BenchConfig("u", api_key="secret"))


# ------------------------------------------------------------------------------------ the stream


def test_token_bearing_chunks() -> None:
    assert _token_text({"text": "Hi", "finish_reason": None}) == "Hi"
    assert _token_text({"text": "", "finish_reason": None}) == ""  # a held-back partial character
    assert _token_text({"text": "", "finish_reason": "length"}) is None  # a bare finish chunk
    assert _token_text({"text": ".", "finish_reason": "length"}) == "."
    assert _token_text({"delta": {"role": "assistant", "content": ""}}) is None  # the chat header
    assert _token_text({"delta": {"content": "x"}, "finish_reason": None}) == "x"
    assert _token_text({"delta": {}, "finish_reason": "stop"}) is None
    assert _token_text({"delta": {"role": "assistant", "content": None}}) is None


def test_root_url() -> None:
    assert root_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert root_url("http://h:1/v1/") == "http://h:1"
    assert root_url("https://h/") == "https://h"


PROMETHEUS = """\
# HELP inferd_preemptions_total Running requests preempted, by how.
# TYPE inferd_preemptions_total counter
inferd_preemptions_total{mode="recompute"} 3.0
inferd_preemptions_total{mode="swap"} 0.0
inferd_rejections_total{reason="queue_full"} 2.0
inferd_prefix_cache_hits_total 64.0
inferd_prefix_cache_queries_total 256.0
inferd_generation_tokens_total{class="batch"} 100.0
inferd_step_seconds_bucket{le="0.1",model="m"} 4.0
"""


def test_counters_and_deltas() -> None:
    before = parse_counters(PROMETHEUS)
    assert before is not None and before["preemptions"] == {"recompute": 3.0, "swap": 0.0}
    assert before["prefix_cache_hits"] == 64.0 and before["timeouts"] == {}
    after = parse_counters(PROMETHEUS.replace("3.0", "5.0").replace("64.0", "96.0").replace("256.0", "320.0"))
    delta = counter_deltas(before, after)
    assert delta is not None
    assert delta["preemptions"] == {"recompute": 2, "swap": 0} and delta["rejections"] == {"queue_full": 0}
    assert delta["prefix_cache_hits"] == 32 and delta["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert parse_counters("vllm:num_requests_running 3\n") is None
    assert counter_deltas(None, after) is None


Handler = Callable[[web.Request], Any]


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "stub"}]})


@pytest_asyncio.fixture
async def stub() -> AsyncIterator[Callable[[Handler], Any]]:
    servers: list[TestServer] = []

    async def start(handler: Handler) -> str:
        application = web.Application()
        application.router.add_post("/v1/completions", handler)
        application.router.add_get("/v1/models", models)
        server = TestServer(application)
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


def sse_handler(*events: str, done: bool = True, abort: bool = False) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(f"data: {event}\n\n".encode())
        if abort:
            assert request.transport is not None
            request.transport.close()
            return response
        if done:
            await response.write(b"data: [DONE]\n\n")
        return response

    return handler


def chunk(text: str, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


async def post(root: str, **kw: Any) -> RequestRecord:
    record = RequestRecord(index=0)
    async with aiohttp.ClientSession() as session:
        return await send(session, f"{root}/v1/completions", {"prompt": "x"}, record, api_key=None, t0=0.0, **kw)


@pytest.mark.asyncio
async def test_send_counts_usage_chunks_and_errors(stub: Callable[[Handler], Any]) -> None:
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    ok = await post(await stub(sse_handler(chunk("a"), chunk(""), chunk("c", "length"), usage)))
    assert ok.ok and ok.chunks == 3 and len(ok.itl) == 2 and ok.status == 200
    assert (ok.output_tokens, ok.prompt_tokens, ok.token_source) == (3, 5, "usage")
    assert ok.ttft is not None and ok.e2e is not None and ok.ttft + sum(ok.itl) == pytest.approx(ok.e2e)

    counted = await post(await stub(sse_handler(chunk("a"), chunk("b"), chunk("", "stop"))))
    assert counted.ok and (counted.output_tokens, counted.token_source, counted.prompt_tokens) == (2, "chunks", None)

    cut = await post(await stub(sse_handler(chunk("a"), chunk("b"), done=False)))
    assert cut.error_type == "incomplete_stream" and cut.output_tokens == 2
    aborted = await post(await stub(sse_handler(chunk("a"), abort=True)))
    assert aborted.error_type == "incomplete_stream"

    error = json.dumps({"error": {"message": "too slow", "type": "timeout_error", "code": "token_timeout"}})
    timed_out = await post(await stub(sse_handler(chunk("a"), error)))
    assert timed_out.error_type == "token_timeout" and "too slow" in (timed_out.error or "")

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "queue full", "type": "rate_limit_error",
                                            "code": "queue_full"}}, status=429)

    refused = await post(await stub(refuse))
    assert (refused.status, refused.error_type, refused.error) == (429, "queue_full", "HTTP 429: queue full")
    empty = await post(await stub(sse_handler()))
    assert empty.error_type == "empty_stream"


@pytest.mark.asyncio
async def test_list_models_errors(stub: Callable[[Handler], Any]) -> None:
    root = await stub(sse_handler())
    async with aiohttp.ClientSession() as session:
        assert await list_models(session, root, None) == ["stub"]
        with pytest.raises(BenchError, match="cannot reach") as info:
            await list_models(session, "http://127.0.0.1:1", None)
        assert info.value.fatal


# ------------------------------------------------------------------------------------ reports


def result_of(label_records: list[tuple[str, list[RequestRecord], float]], url: str = "http://a") -> dict[str, Any]:
    return {
        "tool": "inferd bench", "version": 1, "server": {"url": url, "model": "m", "inferd": True},
        "runs": [{"label": label, "concurrency": 1, "rate": None, "summary": summarize(records, duration=d),
                  "server_counters": None, "requests": [r.to_json() for r in records]}
                 for label, records, d in label_records],
    }


def test_render_run() -> None:
    run = result_of([("concurrency=4", RECORDS, 2.0)])["runs"][0]
    run["server_counters"] = {"preemptions": {"recompute": 2}, "rejections": {}, "timeouts": {},
                              "prefix_cache_hits": 32, "prefix_cache_queries": 64}
    text = text_of(render_run(run))
    assert "3 completed, 2 failed in 2.00 s" in text and "output 3.5 tok/s" in text
    assert re.search(r"TTFT\s+200\.0\s+200\.0\s+280\.0\s+290\.0\s+298\.0", text)
    assert "incomplete_stream 1, queue_full 1" in text and "HTTP 429: 1" in text
    assert "interactive" in text and "batch" in text
    assert "preemptions recompute 2" in text and "prefix-cache hits 32 / 64" in text


def test_compare_output(tmp_path: Path) -> None:
    fast = [rec(i, 0.1, [0.05] * 3, 4, prompt_tokens=10) for i in range(4)]
    slow = [rec(i, 0.2, [0.1] * 3, 4, prompt_tokens=10) for i in range(4)]
    a, b = tmp_path / "inferd.json", tmp_path / "peer.json"
    a.write_text(json.dumps(result_of([("concurrency=1", slow, 4.0)], "http://peer")))
    b.write_text(json.dumps(result_of([("concurrency=1", fast, 2.0)], "http://inferd")))
    console = Console(record=True, width=120, color_system=None, file=io.StringIO())
    compare(str(a), str(b), out=console)
    text = console.export_text()
    assert "inferd.json: http://peer" in text and "peer.json: http://inferd" in text and "concurrency=1" in text
    assert re.search(r"output throughput \(tok/s\)\s+4\.00\s+8\.00\s+2\.00×", text)
    assert re.search(r"TTFT p50 \(ms\)\s+200\.0\s+100\.0\s+0\.50×", text)
    assert re.search(r"TPOT mean \(ms\)\s+100\.0\s+50\.0\s+0\.50×", text)
    assert re.search(r"goodput \(req/s\)\s+-\s+-\s+-", text)
    # through the CLI: `inferd bench compare A B`
    result = CliRunner().invoke(app, ["bench", "compare", str(a), str(b)], env={"COLUMNS": "120"})
    assert result.exit_code == 0 and re.search(r"output throughput \(tok/s\)\s+4\.00\s+8\.00\s+2\.00×", result.output)
    bad = CliRunner().invoke(app, ["bench", "compare", str(a), str(tmp_path / "nope.json")])
    assert bad.exit_code == 1 and "cannot read" in bad.output and "Traceback" not in bad.output


def test_plot_single_run(tmp_path: Path) -> None:
    import matplotlib.image

    result = result_of([("concurrency=4", RECORDS, 2.0)])
    figure = make_figure(result)
    assert [ax.get_title() for ax in figure.axes] == ["TTFT CDF", "TPOT CDF", "E2E latency CDF"]
    assert all(ax.has_data() for ax in figure.axes)
    path = tmp_path / "single.png"
    write_plot(result, path)
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (round(SINGLE_SIZE[1] * DPI), round(SINGLE_SIZE[0] * DPI))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_sweep(tmp_path: Path) -> None:
    import matplotlib.image

    points = [(f"concurrency={c}", [rec(i, 0.1 * c, [0.02 * c] * 3, 4) for i in range(5)], 1.0) for c in (1, 4, 16)]
    result = result_of(points)
    figure = make_figure(result)
    assert len(figure.axes) == 4 and figure.axes[3].get_title() == "throughput vs latency"
    assert len(figure.axes[3].get_lines()) == 4  # TTFT p50/p99, e2e p50/p99
    assert len(figure.axes[0].get_lines()) == 3  # one CDF per point
    path = tmp_path / "sweep.png"
    write_plot(result, path)
    assert matplotlib.image.imread(path).shape[:2] == (round(SWEEP_SIZE[1] * DPI), round(SWEEP_SIZE[0] * DPI))


def test_help_states_the_definitions() -> None:
    result = CliRunner().invoke(app, ["bench", "http://127.0.0.1:1", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for phrase in ("TTFT: request sent -> first chunk carrying a token", "(e2e - TTFT) / (output tokens - 1)",
                   "gaps between consecutive token-bearing chunks", "goodput", "--priority-mix", "--burstiness"):
        assert phrase in result.output, phrase
