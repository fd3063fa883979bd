"""The status dashboard's pure parts: `render` into a recording console, the sparkline, the URL
and error handling of `fetch` (against a local stub server, no engine)."""

from __future__ import annotations

import copy
import http.server
import io
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console

from inferd.client.status import LocalThroughput, StatusError, _request_rows, fetch, render, sparkline, status_url
from inferd.client.status_panels import fmt_count, fmt_share

NOW = 1_800_000_000.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")

LIMITS = {
    "max_waiting": 256, "max_queued_tokens": 65536, "ttft_target": 2.0, "tpot_target": 0.5, "queue_timeout": 60.0,
    "ttft_timeout": None, "token_timeout": 60.0, "total_timeout": 900.0, "max_tokens": 4096, "kv_reserve": 0.0,
    "sheddable": False,
}


def _class(name: str, priority: int, **over: Any) -> dict[str, Any]:
    c = {
        "name": name, "priority": priority, "waiting": 0, "queued_tokens": 0, "oldest_wait_seconds": 0.0, "running": 2,
        "kv_blocks_used": 12, "queued_token_seconds": 3.5, "prompt_tokens": 900, "cached_prompt_tokens": 512,
        "generation_tokens": 3000, "ttft_p50_seconds": 0.1, "ttft_p95_seconds": 0.3, "tpot_p50_seconds": 0.05,
        "queue_time_p95_seconds": 0.01, "finished": {"length": 10}, "preemptions": {}, "timeouts": {},
        "rejections": {}, "deadline_misses": {"ttft": 1}, "limits": dict(LIMITS),
    }
    c.update(over)
    return c


FULL: dict[str, Any] = {
    "model": "smollm2", "max_model_len": 8192,
    "dtype": "bfloat16", "device": "cpu", "version": "0.1.0", "uptime_seconds": 12.5, "state": "ready",
    "kv_blocks_total": 5461, "kv_blocks_used": 12, "kv_blocks_cached": 40, "kv_usage_ratio": 0.0022,
    "running": 2, "waiting": 0, "steps": 1234,
    "preemptions": {"recompute": 3}, "timeouts": {"queue": 1}, "rejections": {"queue_full": 2},
    "prefix_cache_queries": 1000, "prefix_cache_hits": 512, "shed_level": 0, "shed_actions": {"escalate": 1},
    "throughput": {"generation_tokens_per_second": 181.0, "prompt_tokens_per_second": 900.0,
                   "history": [0.0, 12.0, 180.0]},
    "device_memory": None,
    "requests": [{"id": 7, "class": "interactive", "state": "running", "age_seconds": 1.2, "prompt_tokens": 30,
                  "output_tokens": 12, "ttft_seconds": 0.11}],
    "classes": [
        _class("interactive", 0),
        _class("batch", 1, waiting=3, queued_tokens=700, oldest_wait_seconds=4.2, running=0, kv_blocks_used=0,
               ttft_p50_seconds=1.5, ttft_p95_seconds=9.0, timeouts={"queue": 1}, rejections={"queue_full": 2},
               limits={**LIMITS, "ttft_target": 5.0, "sheddable": True}),
    ],
}
NEW_FIELDS = ("dtype", "device", "version", "uptime_seconds", "state", "kv_usage_ratio", "throughput",
              "device_memory", "requests")


def text_of(snapshot: dict[str, Any], width: int = 120, **kwargs: Any) -> str:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(render(snapshot, now=NOW, **kwargs))
    return console.export_text()


def row(text: str, name: str) -> str:
    """The queue-table row of class `name`, without the panel's border."""
    line = next(line for line in text.splitlines() if re.match(rf"^│\s*{name}\s", ANSI.sub("", line)))
    return line.strip().strip("│")


# ------------------------------------------------------------------------------------------


def test_render_full_snapshot() -> None:
    text = text_of(FULL)
    assert "smollm2" in text and "cpu" in text and "bfloat16" in text and "0.1.0" in text and "ready" in text
    interactive, batch = row(text, "interactive"), row(text, "batch")
    assert interactive.split()[1:8] == ["0", "0", "0", "0ms", "2", "12", "100ms"]
    assert "300ms" in interactive and "2.0s" in interactive  # p95 against its TTFT target
    assert batch.split()[1:5] == ["1", "3", "700", "4.2s"] and "9.0s" in batch and "5.0s" in batch
    assert "51%" in text and "prefix-cache hit rate" in text
    assert re.search(r"12 / 5461 blocks used \(0\.2%\)", text) and "40 cached" in text
    assert re.search(r"shed level\s+0 \(escalate 1\)", text)
    assert re.search(r"preemptions\s+recompute 3", text) and re.search(r"rejections\s+queue_full 2", text)
    assert re.search(r"deadline misses\s+ttft 2", text)
    assert re.search(r"\b7\s+interactive\s+running\s+1\.2s\s+30 / 12\s+110ms", text)
    assert "▁▂█" in text and "181.0 tok/s" in text
    assert "device memory" not in text  # null: the line is left out
    assert "Traceback" not in text and max(len(line) for line in text.splitlines()) <= 120


def test_p95_over_target_is_red() -> None:
    console = Console(record=True, width=120, color_system="truecolor", file=io.StringIO())
    console.print(render(FULL, now=NOW))
    styled = console.export_text(styles=True)
    red = re.compile(r"\x1b\[[0-9;]*31m|\x1b\[[0-9;]*38;2;128;0;0m|\x1b\[1;31m")
    batch_line = row(styled, "batch")  # the p95 of 9.0s misses batch's 5.0s target
    interactive_line = row(styled, "interactive")
    assert red.search(batch_line) and not red.search(interactive_line)


def test_render_without_new_fields() -> None:
    old = copy.deepcopy(FULL)
    for key in NEW_FIELDS:
        del old[key]
    for c in old["classes"]:
        del c["limits"]
    text = text_of(old)
    assert "smollm2" in text and row(text, "interactive") and row(text, "batch")
    assert "device -" in text and "dtype -" in text and "51%" in text
    assert "▁" not in text and "requests" in text


@pytest.mark.parametrize("snapshot", [
    {}, {"classes": None, "requests": None, "throughput": None},
    {"classes": [{}], "requests": [{}], "throughput": {"history": []}, "device_memory": {}},
    {"kv_blocks_total": 0, "kv_blocks_used": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0},
    {"tenants": [{}, None, "x"]}, {"tenants": {"acme": {}}},
    {"models": [{}, None, {"aliases": "x", "healthy": False}], "routes": [{}, {"shares": None}, "x"]},
    {"models": {"a": {}}, "routes": {"r": {}}},
])
def test_render_tolerates_sparse_snapshots(snapshot: dict[str, Any]) -> None:
    assert "inferd status" in text_of(snapshot, width=80)


def test_render_device_memory_and_request_cap() -> None:
    snap = copy.deepcopy(FULL)
    snap["device_memory"] = {"used_bytes": 3 * 2**30, "total_bytes": 12 * 2**30}
    snap["requests"] = [
        {"id": i, "class": "batch", "state": "waiting" if i % 2 else "running", "age_seconds": float(i),
         "prompt_tokens": 5, "output_tokens": 0, "ttft_seconds": None}
        for i in range(100, 110)
    ]
    text = text_of(snap, max_requests=3)
    assert "3.0 GiB / 12.0 GiB (25%)" in text
    assert "requests (10), 7 not shown" in text
    shown = re.findall(r"\b(1\d\d)\s+batch\s+(\w+)", text)
    assert shown == [("108", "running"), ("106", "running"), ("104", "running")]  # running first, oldest first


def _tenant(name: str, **over: Any) -> dict[str, Any]:
    t = {
        "name": name, "tier": "gold", "weight": 2.0, "requests": 12345, "prompt_tokens": 1_234_567,
        "completion_tokens": 98_765, "rejections": {"requests": 3, "tokens": 1}, "waiting": 2, "running": 5,
        "virtual_tokens": 61_728.4, "ttft_p50_seconds": 0.12, "ttft_p95_seconds": 0.9, "tpot_p50_seconds": 0.031,
        "remaining_requests": 7, "remaining_tokens": 360_000,
    }
    t.update(over)
    return t


def test_render_tenants() -> None:
    snap = copy.deepcopy(FULL)
    snap["tenants"] = [_tenant("acme"), _tenant("free-tier-co", tier=None, weight=0.5, requests=3, prompt_tokens=900,
                                                 completion_tokens=40, rejections={}, virtual_tokens=1880.0)]
    text = text_of(snap)
    assert "tenants (2)" in text
    assert row(text, "acme").split() == ["acme", "gold", "2", "2", "5", "12.3k", "1.2M", "98.8k", "61.7k", "120ms",
                                         "900ms", "31ms", "4", "7", "360.0k"]
    assert row(text, "free-tier-co").split()[:9] == ["free-tier-co", "-", "0.5", "2", "5", "3", "900", "40", "1880"]
    assert row(text, "free-tier-co").split()[12] == "0"  # rejections: none
    assert text.index("queues") < text.index("tenants (2)") < text.index("KV cache")
    assert max(len(line) for line in text.splitlines()) <= 120


def test_render_the_seats_tenants_gave_to_fair_share() -> None:
    snap = copy.deepcopy(FULL)
    snap["tenants"] = [_tenant("acme", fair_preemptions=0), _tenant("bulk", fair_preemptions=1234)]
    assert "seats given to tenants below their fair share: bulk 1234" in text_of(snap)
    snap["tenants"][1]["fair_preemptions"] = 0
    assert "fair share" not in text_of(snap)


def test_render_tenants_missing_fields() -> None:
    old_server = {"name": "acme", "tier": "gold", "weight": 1.0, "requests": 1}  # the rest not sent
    nulls = _tenant("nolimits", tier=None, ttft_p50_seconds=None, ttft_p95_seconds=None, tpot_p50_seconds=None,
                    remaining_requests=None, remaining_tokens=None, weight=None)
    text = text_of({**FULL, "tenants": [old_server, nulls]})
    assert row(text, "acme").split() == ["acme", "gold", "1", "-", "-", "1"] + ["-"] * 9
    fields = row(text, "nolimits").split()
    assert fields[1:3] == ["-", "-"] and fields[9:12] == ["-", "-", "-"] and fields[13:] == ["-", "-"]
    assert "tenants (1)" in text_of({**FULL, "tenants": [{}]})  # a tenant with nothing at all still renders


@pytest.mark.parametrize("tenants", [None, [], "acme", [None]])
def test_no_tenants_panel_without_tenants(tenants: Any) -> None:
    snap = copy.deepcopy(FULL)
    if tenants is not None:
        snap["tenants"] = tenants
    text = text_of(snap)
    assert "tenants" not in text and row(text, "interactive")


def _screen(n_tenants: int, height: int = 50) -> list[str]:
    """The lines of a `run` frame on a 120 x `height` screen, with 100 requests and `n_tenants`."""
    snap = copy.deepcopy(FULL)
    snap["tenants"] = [_tenant(f"t{i}") for i in range(n_tenants)]
    snap["requests"] = [{"id": i, "class": "batch", "state": "running", "age_seconds": 1.0} for i in range(100)]
    console = Console(record=True, width=120, height=height, color_system=None, file=io.StringIO())
    console.print(render(snap, now=NOW, max_requests=_request_rows(console, snap)))
    return console.export_text().splitlines()


def test_request_table_leaves_room_for_tenants() -> None:
    without = len(_screen(0))
    assert without <= 50
    for n in (1, 4, 10):
        assert len(_screen(n)) == without  # the request table gives up exactly the tenant panel's lines


def _model(name: str, revision: str, **over: Any) -> dict[str, Any]:
    m = {
        "name": name, "revision": revision, "aliases": [], "path": f"/models/{name}", "healthy": True,
        "probe_error": None, "fallback": None, "degraded": False, "degraded_reason": None, "functional_level": "normal",
        "previous_revision": None, "retiring_revisions": [], "running": 2, "waiting": 0, "kv_blocks_used": 12,
        "kv_blocks_total": 5461, "requests": 12345, "fallbacks": 0, "reloads": 0, "reloads_refused": 0,
        "escalations": 0, "tokens_saved": 0, "task": "generate",
        "pooling": {"embed": {"requests": 7, "inputs": 70, "prompt_tokens": 700},
                    "score": {"requests": 0, "inputs": 0, "prompt_tokens": 0}},
    }
    m.update(over)
    return m


SEVERAL_MODELS = {
    "models": [
        _model("llama", "r2", aliases=["chat"], reloads=2, reloads_refused=1),
        _model("small", "r1", fallback="llama", degraded=True, degraded_reason="kv full", functional_level="capped",
               running=9, waiting=41, kv_blocks_used=5400, requests=800, fallbacks=321, escalations=57,
               tokens_saved=45_678, pooling=None),
    ],
    "routes": [{"name": "chat-split", "kind": "split", "shares": {"llama": 0.9, "small": 0.1}}],
}


def test_render_models_and_routes() -> None:
    text = text_of({**FULL, **SEVERAL_MODELS})
    assert "models (2)" in text
    assert row(text, "llama@r2").split() == ["llama@r2", "(chat)", "ok", "normal", "2/0", "12/5461", "12.3k", "7/0",
                                             "0", "2/1", "0/0"]
    assert row(text, "small@r1").split() == ["small@r1", "degraded", "→", "llama", "(kv…", "capped", "9/41",
                                             "5400/5461", "800", "-", "321", "0/0", "57/45.7k"]
    assert re.search(r"route chat-split\s+split\s+llama 90% · small 10%", text)
    assert text.index("inferd status") < text.index("models (2)") < text.index("queues")
    assert max(len(line) for line in text.splitlines()) <= 120


def test_render_models_health() -> None:
    error = "inference probe produced [1, 2, 3, 4, 5, 6, 7, 8], expected [9, 9]\nand more"
    sick = _model("sick", "r3", healthy=False, probe_error=error, functional_level="refuse_lowest")
    text = text_of({**FULL, "models": [sick, _model("mute", "r1", healthy=False), _model("old", "r0", healthy=None)]},
                   width=160)
    assert "inference probe produced [1, 2, 3, 4, 5…" in text and "and more" not in text  # cut to 40 characters
    assert row(text, "sick@r3").split()[-8] == "refuse_lowest"
    assert row(text, "mute@r1").split()[1] == "unhealthy" and row(text, "old@r0").split()[1] == "-"


def test_render_models_states() -> None:
    """Models on demand: a state other than serving stands in the health column; loads/switches."""
    life = {"loads": 3, "switches": 2}
    models = [_model("a", "1", state="serving", life=life),
              _model("b", "1", state="asleep", life={"sleep_level": 2, "loads": 1, "switches": 0}),
              _model("c", "1", state="failed", healthy=False, life={"load_error": "truncated GGUF header"}),
              _model("d", "1", state="unloaded", life=None)]
    text = text_of({**FULL, "models": models}, width=160)
    assert row(text, "a@1").split()[1] == "ok" and row(text, "a@1").split()[-1] == "3/2"
    assert "asleep (level 2)" in row(text, "b@1") and row(text, "b@1").split()[-1] == "1/0"
    assert "failed: truncated GGUF header" in row(text, "c@1")
    assert row(text, "d@1").split()[1] == "unloaded" and row(text, "d@1").split()[-1] == "-/-"


@pytest.mark.parametrize("several", [
    {}, {"models": [], "routes": []}, {"models": None, "routes": None},
    {"models": [_model("smollm2", "main")]}, {"models": [_model("smollm2", "main")], "routes": []},
])
def test_no_models_panel_for_one_model_and_no_routes(several: dict[str, Any]) -> None:
    text = text_of({**FULL, **several})
    assert "models (" not in text and "route " not in text and row(text, "interactive")


def test_render_routes_without_models() -> None:
    """Routes alone (however odd) still show: they say where requests go."""
    text = text_of({**FULL, "routes": [{"name": "cheap", "kind": "cascade", "shares": {"small": 1.0}}]})
    assert "models (0)" in text and re.search(r"route cheap\s+cascade\s+small 100%", text)


def test_request_table_leaves_room_for_models() -> None:
    snap = copy.deepcopy(FULL)
    snap["requests"] = [{"id": i, "class": "batch", "state": "running", "age_seconds": 1.0} for i in range(100)]
    for several in (SEVERAL_MODELS, {"models": SEVERAL_MODELS["models"] * 3}, {"routes": SEVERAL_MODELS["routes"] * 2}):
        with_models = {**snap, **several}
        console = Console(record=True, width=120, height=50, color_system=None, file=io.StringIO())
        console.print(render(with_models, now=NOW, max_requests=_request_rows(console, with_models)))
        assert len(console.export_text().splitlines()) == len(_screen(0))  # the request table makes room


DRIFT = {"baseline_requests": 200, "baseline_complete": True, "window_seconds": 300.0, "window_requests": 42,
         "psi": {"prompt_tokens": 1.234, "completion_tokens": 0.15, "finish_reason": 0.01}, "mean_prompt_tokens": 812.4,
         "mean_completion_tokens": 64.0, "refusal_rate": 0.025, "languages": {"latin": 1.0},
         "finish_reasons": {"stop": 1.0}}


def test_render_drift_only_when_the_server_sends_it() -> None:
    assert "drift" not in text_of(FULL) and "drift" not in text_of({**FULL, "drift": None})
    text = text_of({**FULL, "drift": DRIFT})
    assert "prompt len 1.23" in text and "output len 0.15" in text and "finish 0.01" in text
    assert "window 42 req" in text and "prompt 812 tok" in text and "refusals 2.5%" in text
    assert "(filling)" not in text and "(filling)" in text_of({**FULL, "drift": {**DRIFT, "baseline_complete": False}})
    assert "still empty" in text_of({**FULL, "drift": {**DRIFT, "psi": {}}})
    snap = copy.deepcopy(FULL)
    snap["requests"] = [{"id": i, "class": "batch", "state": "running", "age_seconds": 1.0} for i in range(100)]
    for with_drift in (snap, {**snap, "drift": DRIFT}):
        console = Console(record=True, width=120, height=50, color_system=None, file=io.StringIO())
        console.print(render(with_drift, now=NOW, max_requests=_request_rows(console, with_drift)))
        assert len(console.export_text().splitlines()) == len(_screen(0))  # the request table makes room


def test_fmt_count() -> None:
    assert [fmt_count(v) for v in (0, 9999, 10_000, 12_345, 999_949, 999_999, 1_234_567, 2.5e9)] == [
        "0", "9999", "10.0k", "12.3k", "999.9k", "1.0M", "1.2M", "2.5G"]
    assert fmt_count(None) == fmt_count(float("nan")) == fmt_count(True) == "-"


def test_fmt_share() -> None:
    assert [fmt_share(v) for v in (0.9, 0.1, 1.0, 1 / 3, 0.005, 0)] == ["90%", "10%", "100%", "33.3%", "0.5%", "0%"]
    assert fmt_share(None) == fmt_share(True) == "-"


def test_sparkline() -> None:
    assert sparkline([]) == ""
    assert sparkline([0, 0]) == "▁▁"
    assert sparkline([0.0, 12.0, 180.0]) == "▁▂█"
    assert sparkline(range(100)) == sparkline(range(40, 100))  # the last 60 only
    assert len(sparkline(range(100))) == 60 and sparkline(range(100))[-1] == "█"


def test_status_url() -> None:
    assert status_url("http://h:1") == "http://h:1/v1/status"
    assert status_url("h:1/") == "http://h:1/v1/status"
    assert status_url("https://h/v1") == "https://h/v1/status"
    assert status_url("http://h:1/v1/status") == "http://h:1/v1/status"


def test_local_throughput_fills_in_for_old_servers() -> None:
    tracker = LocalThroughput(interval=1.0)
    old = {"classes": [{"generation_tokens": 100, "prompt_tokens": 10}, {"generation_tokens": 0, "prompt_tokens": 0}]}
    first = tracker.fill(old, now=10.0)
    assert first["throughput"]["history"] == [] and "throughput" not in old
    later = {"classes": [{"generation_tokens": 150, "prompt_tokens": 30}, {"generation_tokens": 50}]}
    tp = tracker.fill(later, now=12.0)["throughput"]  # 100 more tokens in 2 s
    assert tp["history"] == [50.0] and tp["generation_tokens_per_second"] == 50.0
    assert tp["prompt_tokens_per_second"] == 10.0
    assert tracker.fill(FULL, now=13.0) is FULL  # the server's own history wins


# ------------------------------------------------------------------------------ fetch errors


class _Stub(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802
        code, body = self.routes.get(self.path, (404, b"{}"))
        if self.path == "/key/v1/status" and self.headers.get("Authorization") == "Bearer good":
            code, body = 200, json.dumps(FULL).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    _Stub.routes = {
        "/ok/v1/status": (200, json.dumps(FULL).encode()),
        "/key/v1/status": (401, b'{"error": {"message": "missing API key", "type": "x", "param": null, "code": "k"}}'),
        "/html/v1/status": (200, b"<html></html>"),
        "/boom/v1/status": (500, b"oops"),
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetch(stub: str) -> None:
    assert fetch(f"{stub}/ok")["model"] == "smollm2"
    assert fetch(f"{stub}/key", api_key="good")["model"] == "smollm2"


@pytest.mark.parametrize(("path", "key", "message"), [
    ("/key", None, "needs an API key (missing API key): pass --api-key KEY or set INFERD_API_KEY"),
    ("/key", "bad", "rejected the API key"),
    ("/html", None, "did not answer with a JSON object"),
    ("/boom", None, "answered HTTP 500"),
    ("/nothing", None, "not found (HTTP 404)"),
])
def test_fetch_errors(stub: str, path: str, key: str | None, message: str) -> None:
    with pytest.raises(StatusError, match=re.escape(message)):
        fetch(f"{stub}{path}", api_key=key)
