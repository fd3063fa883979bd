"""GET /metrics on the real default model: Prometheus text that prometheus_client parses, with
every metric the operator guide lists, and values that move with a load and settle after it."""

from __future__ import annotations

import asyncio

import pytest
from apiserver import MODEL, Server
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

EXPECTED = {
    "inferd_requests_waiting", "inferd_requests_running", "inferd_queued_tokens", "inferd_queued_token_seconds",
    "inferd_oldest_wait_seconds", "inferd_kv_blocks_total", "inferd_kv_blocks_used", "inferd_kv_usage_ratio",
    "inferd_prefix_cache_queries", "inferd_prefix_cache_hits", "inferd_prompt_tokens", "inferd_generation_tokens",
    "inferd_ttft_seconds", "inferd_itl_seconds", "inferd_tpot_seconds", "inferd_e2e_seconds",
    "inferd_queue_time_seconds", "inferd_preemptions", "inferd_timeouts", "inferd_rejections",
    "inferd_deadline_misses", "inferd_step_seconds", "inferd_batch_tokens", "inferd_shed_level",
}


async def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as {(name, sorted labels): value}; checks the families parse."""
    async with server.session.get("/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    families = list(text_string_to_metric_families(text))
    assert EXPECTED <= {f.name for f in families}, EXPECTED - {f.name for f in families}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_metrics_move_with_a_load_and_settle(server: Server) -> None:
    before = await scrape(server)
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    results = await asyncio.gather(
        *(server.post("/v1/completions", {**body, "prompt": f"Number {i} is", "priority": ("interactive", "batch")[i % 2]})
          for i in range(8)))
    assert all(status == 200 for status, _ in results)
    over = await server.post("/v1/completions", {**body, "prompt": "x", "priority": "nope"})
    assert over[0] == 400
    await asyncio.sleep(0.2)  # the engine publishes its stats at most every 50 ms
    after = await scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for cls in ("interactive", "batch"):
        assert delta("inferd_generation_tokens_total", **{"class": cls}) == 4 * 6
        assert delta("inferd_ttft_seconds_count", **{"class": cls, "model": MODEL}) == 4
        assert delta("inferd_e2e_seconds_count", **{"class": cls, "model": MODEL}) == 4
        assert delta("inferd_itl_seconds_count", **{"class": cls, "model": MODEL}) == 4 * 5
        assert delta("inferd_prompt_tokens_total", **{"class": cls}) > 0
        assert value(after, "inferd_requests_running", **{"class": cls}) == 0
        # cumulative buckets end at +Inf = count
        assert value(after, "inferd_ttft_seconds_bucket", **{"class": cls, "model": MODEL, "le": "+Inf"}) == \
            value(after, "inferd_ttft_seconds_count", **{"class": cls, "model": MODEL})
    assert value(after, "inferd_kv_blocks_used") == 0 and value(after, "inferd_kv_usage_ratio") == 0
    assert value(after, "inferd_kv_blocks_total") > 0
    assert delta("inferd_step_seconds_count", model=MODEL) > 0
    assert value(after, "inferd_shed_level") == 0
    # label values come from the configuration only
    classes = {dict(labels).get("class") for (_, labels) in after} - {None}
    assert classes == {"interactive", "batch"}
