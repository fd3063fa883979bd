"""Drift statistics: the PSI math and the windows on a fake clock, then over HTTP: a batch of long
prompts after a baseline of short ones moves inferd_drift_psi{feature="prompt_tokens"} and
/v1/status's drift, while the features that did not change stay put."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from apiserver import MODEL, Server, serve
from prometheus_client.parser import text_string_to_metric_families

from inferd.api.telemetry.drift import EPSILON, DriftMonitor, Observation, RefusalMatcher, length_bin, psi, script_shares
from inferd.settings.config import Settings
from inferd.engine.llm_engine import LLMEngine


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def obs(prompt: int = 10, completion: int = 8, finish: tuple[str, ...] = ("stop",), refusals: int = 0,
        languages: dict[str, float] | None = None) -> Observation:
    return Observation(prompt, completion, finish, refusals, {"latin": 1.0} if languages is None else languages)


# ----------------------------------------------------------------------------------- the math


def test_psi_is_zero_for_the_same_distribution_and_symmetric() -> None:
    assert psi({"a": 10, "b": 30}, {"a": 1, "b": 3}) == pytest.approx(0.0)
    base, cur = {"a": 50, "b": 50}, {"a": 80, "b": 20}
    expected = (0.8 - 0.5) * math.log(0.8 / 0.5) + (0.2 - 0.5) * math.log(0.2 / 0.5)
    assert psi(base, cur) == pytest.approx(expected)
    assert psi(cur, base) == pytest.approx(expected)


def test_psi_counts_an_empty_bin_as_epsilon_and_needs_both_sides() -> None:
    value = psi({"a": 1}, {"b": 1})
    assert value == pytest.approx(2 * (1 - EPSILON) * math.log(1 / EPSILON), rel=1e-3)
    assert value is not None and value > 0.2
    assert psi({}, {"a": 1}) is None and psi({"a": 1}, {}) is None


def test_bins_and_detectors() -> None:
    assert [length_bin(n) for n in (0, 1, 2, 3, 4, 7, 8, 1000)] == ["0", "1", "2", "2", "4", "4", "8", "512"]
    assert script_shares("Hello мир") == pytest.approx({"latin": 5 / 8, "cyrillic": 3 / 8})
    assert set(script_shares("你好 こんにちは 안녕 مرحبا")) == {"cjk", "arabic"}
    assert script_shares("12345 !!") == {}
    assert script_shares("Γειά") == {"other": 1.0}
    refusal = RefusalMatcher(["I'm sorry", "As an AI"])
    assert refusal("Well, i’M SORRY, but no") and refusal("as an ai model") and not refusal("Sure! Here it is.")
    assert not RefusalMatcher([])("I'm sorry")


# -------------------------------------------------------------------------------- the windows


def test_the_baseline_fills_first_then_the_window_slides() -> None:
    clock = FakeClock()
    monitor = DriftMonitor(window_seconds=100.0, baseline_requests=4, clock=clock)
    for _ in range(4):
        monitor.observe(obs(prompt=10))
    report = monitor.report()
    assert report.baseline_complete and report.baseline_requests == 4
    assert report.window_requests == 0 and report.psi == {} and report.mean_prompt_tokens is None
    for _ in range(3):
        monitor.observe(obs(prompt=10))
    assert monitor.report().psi["prompt_tokens"] == pytest.approx(0.0)
    clock.now += 50
    for _ in range(3):
        monitor.observe(obs(prompt=1000, languages={"cjk": 1.0}))
    report = monitor.report()
    assert report.window_requests == 6 and report.mean_prompt_tokens == pytest.approx(505)
    assert 0.2 < report.psi["prompt_tokens"] and 0.2 < report.psi["language"]
    assert report.psi["finish_reason"] == pytest.approx(0.0) and report.psi["completion_tokens"] == pytest.approx(0.0)
    assert report.languages == pytest.approx({"cjk": 0.5, "latin": 0.5})
    clock.now += 60  # the short ones age out; the long ones are 60 s old
    report = monitor.report()
    assert report.window_requests == 3 and report.mean_prompt_tokens == pytest.approx(1000)
    assert report.languages == {"cjk": 1.0}
    clock.now += 100  # everything ages out: sums and histograms back to empty
    report = monitor.report()
    assert report.window_requests == 0 and report.psi == {} and report.languages == {}
    assert all(not counts for counts in monitor.window.features.values()) and not monitor.window.sums


def test_refusals_and_finish_reasons_per_choice() -> None:
    monitor = DriftMonitor(window_seconds=10.0, baseline_requests=1, clock=FakeClock())
    monitor.observe(obs(finish=("stop", "stop")))
    monitor.observe(obs(completion=30, finish=("stop", "length", "length"), refusals=1))
    report = monitor.report()
    assert report.refusal_rate == pytest.approx(1 / 3) and report.mean_completion_tokens == pytest.approx(10)
    assert report.finish_reasons == pytest.approx({"length": 2 / 3, "stop": 1 / 3})
    assert report.psi["refusal"] > 0.2 and report.psi["finish_reason"] > 0.2


def test_the_window_keeps_a_bounded_number_of_buckets() -> None:
    clock = FakeClock()
    monitor = DriftMonitor(window_seconds=10.0, baseline_requests=1, clock=clock)
    for _ in range(1000):
        monitor.observe(obs())
        clock.now += 0.37
    assert len(monitor._buckets) <= 11
    assert monitor.report().window_requests == pytest.approx(10 / 0.37, abs=4)


# ------------------------------------------------------------------------------------ over HTTP


async def scrape_psi(server: Server) -> dict[str, float]:
    async with server.session.get("/metrics") as r:
        text = await r.text()
    return {s.labels["feature"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "inferd_drift_psi" for s in f.samples}


@pytest.mark.served
@pytest.mark.asyncio
async def test_long_prompts_after_a_short_baseline_move_the_prompt_psi(llm: LLMEngine, tmp_path: Path) -> None:
    settings = Settings.model_validate({"request_log": {"path": str(tmp_path / "requests.jsonl"),
                                                        "baseline_requests": 6}})
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    async with serve(llm, settings) as server:
        # NOTE: one at a time: a burst of long prompts would trip load shedding in the shared engine
        for i in range(6):
            assert (await server.post("/v1/completions", {**body, "prompt": f"Hi {i}"}))[0] == 200
        assert await scrape_psi(server) == {}  # a baseline, no window yet
        long_prompt = "The quick brown fox jumps over the lazy dog. " * 12
        for i in range(6):
            assert (await server.post("/v1/completions", {**body, "prompt": f"{i} {long_prompt}"}))[0] == 200
        values = await scrape_psi(server)
        assert values["prompt_tokens"] > 0.2
        for unchanged in ("completion_tokens", "finish_reason", "refusal", "language"):
            assert values[unchanged] < 0.05, (unchanged, values)
        status, reply = await server.get("/v1/status")
        assert status == 200
        drift = reply["drift"]
        assert drift["baseline_complete"] and drift["baseline_requests"] == 6 and drift["window_requests"] == 6
        assert drift["psi"]["prompt_tokens"] == pytest.approx(values["prompt_tokens"], rel=1e-3)
        assert drift["mean_prompt_tokens"] > 100 and drift["mean_completion_tokens"] == 3
        assert drift["finish_reasons"] == {"length": 1.0} and drift["languages"]["latin"] > 0.9


@pytest.mark.served
@pytest.mark.asyncio
async def test_no_drift_without_the_request_log(llm: LLMEngine) -> None:
    async with serve(llm) as server:
        status, reply = await server.get("/v1/status")
        assert status == 200 and reply["drift"] is None
        assert await scrape_psi(server) == {}
