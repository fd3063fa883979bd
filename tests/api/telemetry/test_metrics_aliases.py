"""The `vllm:` aliases on /metrics that the Gateway API Inference Extension's endpoint picker
reads (docs/kubernetes.md): on a real server under a load, every scrape's alias equals the inferd
metric it stands for in that same scrape, with the picker's types and labels."""

from __future__ import annotations

import asyncio
import time

import pytest
from apiserver import MODEL, Server
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

# alias -> the inferd family it equals (summed over its `class` label where it has one)
ALIASES = {
    "vllm:num_requests_waiting": "inferd_requests_waiting",
    "vllm:num_requests_running": "inferd_requests_running",
    "vllm:kv_cache_usage_perc": "inferd_kv_usage_ratio",
    "vllm:gpu_cache_usage_perc": "inferd_kv_usage_ratio",
}


async def scrape(server: Server) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    """Each family as {name: [(labels, value, type)]}, parsed as Prometheus (and the picker) would."""
    async with server.session.get("/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {f.name: [(s.labels, s.value, f.type) for s in f.samples] for f in text_string_to_metric_families(text)}


def check_aliases(families: dict[str, list[tuple[dict[str, str], float, str]]], block_size: int) -> float:
    """Assert every alias equals its inferd metric in this scrape; returns vllm:num_requests_running."""
    for alias, own in ALIASES.items():
        [(labels, value, kind)] = families[alias]
        assert kind == "gauge" and labels == {"model_name": MODEL}, (alias, labels, kind)
        assert value == sum(v for _, v, _ in families[own]), (alias, value, families[own])
    [(labels, value, kind)] = families["vllm:cache_config_info"]
    [(_, total, _)] = families["inferd_kv_blocks_total"]
    assert kind == "gauge" and value == 1
    assert labels == {"block_size": str(block_size), "num_gpu_blocks": str(int(total))}
    [(labels, value, kind)] = families["vllm:lora_requests_info"]
    assert kind == "gauge" and labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert 0 < value <= time.time()  # a wall-clock timestamp: the picker keeps the newest series
    [(_, running, _)] = families["vllm:num_requests_running"]
    return running


async def test_aliases_equal_inferd_metrics_under_load(server: Server) -> None:
    block_size = server.engine.limits.block_size
    idle = await scrape(server)
    assert check_aliases(idle, block_size) == 0
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    load = [asyncio.ensure_future(server.post("/v1/completions", {**body, "prompt": f"Count to {i}:"}))
            for i in range(4)]
    busy = []  # scrapes that saw requests running (the engine publishes every ~50 ms)
    deadline = time.monotonic() + 60
    while not all(t.done() for t in load):
        assert time.monotonic() < deadline, "the load never finished"
        families = await scrape(server)
        if check_aliases(families, block_size) > 0:
            busy.append(families)
        await asyncio.sleep(0.02)
    assert all(status == 200 for status, _ in await asyncio.gather(*load))
    assert busy, "no scrape saw a request running"
    assert any(f["vllm:kv_cache_usage_perc"][0][1] > 0 for f in busy)
