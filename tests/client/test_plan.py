"""`inferd plan`: Little's-law sizing from `inferd bench --json` sweeps, checked against arithmetic done
by hand, on a fabricated sweep (exact numbers) and on a sweep recorded from a real server
(tests/client/data/cpu_sweep/, made by the commands in docs/scaling.md); bad inputs through the CLI."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from inferd.cli import app
from inferd.client.bench_metrics import RequestRecord, summarize
from inferd.client.plan import PlanError, PlanInput, SweepPoint, load_points, make_plan, plan_files
from inferd.client.plan_render import render, to_json

DATA = Path(__file__).parent / "data"
RECORDED = sorted((DATA / "cpu_sweep").glob("c*.json"))  # inferd bench --json, one file per concurrency
REPO = Path(__file__).resolve().parents[2]


def text_of(renderable: Any, width: int = 120) -> str:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def run_of(concurrency: int, ttfts: list[float], e2es: list[float], failed: int = 0) -> dict[str, Any]:
    """A closed-loop run as `inferd bench --json` writes it, from per-request TTFT and e2e."""
    records = [RequestRecord(index=i, ttft=t, itl=[e - t], e2e=e, elapsed=e, prompt_tokens=48, output_tokens=2,
                             token_source="usage", status=200) for i, (t, e) in enumerate(zip(ttfts, e2es))]
    records += [RequestRecord(index=len(records) + k, elapsed=0.01, status=429, error_type="queue_full",
                              error="HTTP 429: full") for k in range(failed)]
    duration = sum(e2es) / concurrency
    return {"label": f"concurrency={concurrency}", "concurrency": concurrency, "rate": None, "burstiness": None,
            "summary": summarize(records, duration=duration), "server_counters": None,
            "requests": [r.to_json() for r in records]}


def result_of(*runs: dict[str, Any], model: str = "m") -> dict[str, Any]:
    return {"tool": "inferd bench", "version": 1, "created": "2025-01-01T00:00:00+00:00", "config": {},
            "server": {"url": "http://box:8000", "model": model, "inferd": True}, "runs": list(runs)}


# The hand-computed sweep: four requests per point, every one alike, so each percentile is the value.
#   concurrency 1:  TTFT 0.25 s, e2e 3.25 s   met
#   concurrency 4:  TTFT 0.5 s,  e2e 4 s      met
#   concurrency 16: TTFT 0.875 s, e2e 6.5 s   met the TTFT SLO (p99 0.875 ≤ 1), missed e2e ≤ 6
#   concurrency 32: TTFT 1.75 s, e2e 9 s      missed TTFT (1.75 > 1)
HAND = result_of(
    run_of(1, [0.25] * 4, [3.25] * 4),
    run_of(4, [0.5] * 4, [4.0] * 4),
    run_of(16, [0.875] * 4, [6.5] * 4),
    run_of(32, [1.75] * 4, [9.0] * 4),
)


@pytest.fixture
def hand_file(tmp_path: Path) -> Path:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(HAND))
    return path


def test_hand_computed_plan(hand_file: Path) -> None:
    # QPS 5, SLO p99 TTFT ≤ 1 s, 20 % headroom, N+1:
    #   c  = 16 (32 missed: TTFT p99 1.75 s > 1 s), W = mean e2e at 16 = 6.5 s
    #   L  = λW = 5 × 6.5 = 32.5 requests in flight
    #   L' = 32.5 × 1.2 = 39
    #   N  = ceil(39 / 16) = ceil(2.4375) = 3; replicas = 3 + 1 = 4
    #   KEDA threshold = c / 1.2 = 16 / 1.2 = 13.333 requests in flight per replica
    plan = plan_files([hand_file], qps=5, slo="ttft=1", headroom=20)
    assert plan.chosen.concurrency == 16 and plan.latency == 6.5
    assert plan.in_flight == 32.5 and plan.in_flight_headroom == pytest.approx(39)
    assert (plan.boxes, plan.replicas) == (3, 4)
    assert plan.keda_target == pytest.approx(16 / 1.2)
    assert [why for _, why in plan.points] == [None, None, None, "TTFT p99 1.75 s > 1 s"]
    text = text_of(render(plan))
    for line in ("c  = 16", "W  = 6.5 s", "L  = λ × W = 5 × 6.5 = 32.5", "L' = L × 1.2 = 39",
                 "N  = ceil(L' / c) = ceil(39 / 16) = ceil(2.438) = 3", "replicas = N + 1 = 3 + 1 = 4",
                 "13.33 per replica = c / (1 + headroom) = 16 / 1.2", "missed: TTFT p99 1.75 s > 1 s",
                 "sum(avg_over_time(inferd_requests_running[2m])) + sum(avg_over_time(inferd_requests_waiting[2m]))",
                 "minReplicaCount   2"):
        assert line in text, line
    # Without headroom: N = ceil(32.5 / 16) = ceil(2.03) = 3 (a ceiling: 2 boxes would hold 32 < 32.5)
    plan = plan_files([hand_file], qps=5, slo="ttft=1")
    assert (plan.boxes, plan.replicas, plan.keda_target) == (3, 4, 16)
    # With an e2e SLO of 6 s as well, 16 misses (6.5 > 6): c = 4, W = 4 s, L = 20, N = ceil(20 / 4) = 5, +2 = 7
    plan = plan_files([hand_file], qps=5, slo="ttft=1,e2e=6", spare=2)
    assert (plan.chosen.concurrency, plan.in_flight, plan.boxes, plan.replicas) == (4, 20, 5, 7)
    assert "N  = ceil(L / c) = ceil(20 / 4) = ceil(5) = 5" in text_of(render(plan))


def points_of(tmp_path: Path, *runs: dict[str, Any]) -> list[SweepPoint]:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result_of(*runs)))
    return load_points([path])


def test_float_noise_costs_no_box(tmp_path: Path) -> None:
    # λ = 3, W = 3.2 s at c = 4, 25 % headroom: L' = 3 × 3.2 × 1.25 = 12 = 3 boxes × 4 exactly,
    # though in floats 12.000000000000002 / 4 = 3.0000000000000004, whose ceiling is 4
    points = points_of(tmp_path, run_of(4, [0.1], [3.2]))
    plan = make_plan(points, PlanInput(qps=3, slo={"ttft": 1}, headroom=25, spare=0))
    assert plan.in_flight_headroom / 4 > 3 and (plan.boxes, plan.replicas) == (3, 3)
    # an exact fit: λ = 5, W = 6.4 s at c = 16: N = ceil(5 × 6.4 / 16) = ceil(2) = 2, + 1 = 3
    plan = make_plan(points_of(tmp_path, run_of(16, [0.5], [6.4])), PlanInput(qps=5, slo={"ttft": 1}))
    assert (plan.boxes, plan.replicas) == (2, 3)


def test_percentile_failures_and_notes(tmp_path: Path) -> None:
    # concurrency 8: 15 requests at TTFT 0.5 s and one at 1.2 s: p90 = 0.5 meets 1 s;
    # p99 = 0.5 + 0.7 × 0.85 = 1.095 (numpy's interpolation, rank 14.85 of 0..15) misses it
    slow_tail = run_of(8, [0.5] * 15 + [1.2], [2.0] * 16)
    points = points_of(tmp_path, run_of(2, [0.2] * 4, [1.0] * 4), slow_tail)
    assert make_plan(points, PlanInput(qps=1, slo={"ttft": 1}, percentile=90)).chosen.concurrency == 8
    p99 = make_plan(points, PlanInput(qps=1, slo={"ttft": 1}))
    assert p99.chosen.concurrency == 2 and p99.points[1][1] == "TTFT p99 1.09 s > 1 s"
    # a run with a failed request never qualifies, whatever its latencies
    points = points_of(tmp_path, run_of(2, [0.2] * 4, [1.0] * 4), run_of(4, [0.2] * 4, [1.0] * 4, failed=1))
    plan = make_plan(points, PlanInput(qps=1, slo={"ttft": 1}))
    assert plan.chosen.concurrency == 2 and plan.points[1][1] == "1 of 5 requests failed"
    # the top of the sweep met the SLO: say that a box may take more; a lower point that missed: noise
    points = points_of(tmp_path, run_of(2, [1.5] * 4, [3.0] * 4), run_of(4, [0.5] * 4, [3.0] * 4))
    notes = make_plan(points, PlanInput(qps=1, slo={"ttft": 1})).notes
    assert any("concurrency 2 missed the SLO though 4 met it" in n for n in notes)
    assert any("the highest concurrency measured (4) met the SLO" in n for n in notes)


def test_json_output(hand_file: Path) -> None:
    d = to_json(plan_files([hand_file], qps=5, slo="ttft=1", headroom=20))
    assert d["tool"] == "inferd plan" and d["chosen"] == "sweep.json: concurrency=16"
    assert d["little"] | {"L_with_headroom": 39} == {"c": 16, "W_s": 6.5, "W_is": "mean e2e latency at c", "L": 32.5,
                                                    "L_with_headroom": 39, "N": 3, "replicas": 4,
                                                    "verify_rate": 5 / 3}
    assert d["keda"]["threshold"] == pytest.approx(13.3333333) and d["keda"]["min_replica_count"] == 2
    assert [p["met"] for p in d["points"]] == [True, True, True, False]
    json.dumps(d)  # plain data


# ------------------------------------------------------------------------------------ recorded


def recorded_summaries() -> dict[int, dict[str, Any]]:
    """Concurrency -> the run's summary, one run per recorded file."""
    runs = [json.loads(path.read_text())["runs"][0] for path in RECORDED]
    return {run["concurrency"]: run["summary"] for run in runs}


def test_recorded_sweep_hand_computed() -> None:
    """The sweep recorded from `inferd serve` (SmolLM2-135M Q4_1, bfloat16) on this project's 2-core
    AMD EPYC CPU, no GPU: one file per concurrency, 15 s each; the commands are in docs/scaling.md.

        c    TTFT p99   E2E p99   E2E mean   req/s
        1    0.112      3.107     2.544      0.393
        2    0.228      3.019     2.766      0.722
        4    0.301      3.751     3.406      1.174
        8    0.449      4.299     4.067      1.966
        16   0.851      5.683     5.635      2.832
        32   1.344      9.395     9.154      3.471

    QPS 20, SLO p99 TTFT ≤ 1 s and p99 e2e ≤ 8 s, 20 % headroom, N+1:
        32 misses (TTFT 1.344 > 1, e2e 9.395 > 8); 16 meets (0.851, 5.683): c = 16, W = 5.635 s
        L = 20 × 5.635 = 112.7; L' = 112.7 × 1.2 = 135.24; N = ceil(135.24 / 16) = ceil(8.45) = 9
        replicas = 9 + 1 = 10; KEDA threshold 16 / 1.2 = 13.33 in flight per replica; λ / N = 2.22 req/s
    """
    plan = plan_files(RECORDED, qps=20, slo="ttft=1,e2e=8", headroom=20)
    assert plan.concurrency == 16 and plan.latency == pytest.approx(5.635, abs=5e-4)
    assert plan.in_flight == pytest.approx(112.7, abs=0.01) and plan.in_flight_headroom == pytest.approx(135.24, abs=0.01)
    assert (plan.boxes, plan.replicas) == (9, 10) and plan.keda_target == pytest.approx(13.33, abs=0.005)
    assert plan.verify_rate == pytest.approx(2.222, abs=5e-4)
    assert [p.concurrency for p, why in plan.points if why] == [32] and not plan.notes
    # p99 TTFT ≤ 0.4 s alone: 8 misses (0.449), 4 meets (0.301): c = 4, W = 3.406 s, no headroom:
    # N = ceil(20 × 3.406 / 4) = ceil(17.03) = 18, + 1 = 19: a tight TTFT target costs boxes
    plan = plan_files(RECORDED, qps=20, slo="ttft=0.4")
    assert (plan.concurrency, plan.boxes, plan.replicas) == (4, 18, 19)
    # p99 TTFT ≤ 2 s: every point meets it; c = 32, W = 9.154 s, N = ceil(20 × 9.154 / 32) = ceil(5.72) = 6,
    # + 1 = 7, and a note to sweep higher
    plan = plan_files(RECORDED, qps=20, slo="ttft=2")
    assert (plan.concurrency, plan.boxes, plan.replicas) == (32, 6, 7)
    assert any("the highest concurrency measured (32) met the SLO" in n for n in plan.notes)


def test_recorded_open_loop_checks() -> None:
    """The plan above checked on one box with Poisson arrivals for 60 s (recorded, docs/scaling.md).

    At λ / N = 2.22 req/s: p99 TTFT 0.353 s, p99 e2e 6.363 s: within ttft ≤ 1 s, e2e ≤ 8 s. With
    e2e ≤ 6 s the closed loop still picks 16 (p99 5.683 s), but the open loop misses it, and so
    does --headroom 50 (N = ceil(112.7 × 1.5 / 16) = 11, λ / N = 1.82 req/s: p99 e2e 6.74 s).
    """
    opened = sorted(DATA.glob("cpu_sweep/open_rate*.json"))
    plan = plan_files([*RECORDED, *opened], qps=20, slo="ttft=1,e2e=8", headroom=20)
    assert [(p.rate, why) for p, why in plan.open_loop] == [(1.82, None), (2.22, None)] and not plan.notes
    assert "open loop at 2.22 req/s (open_rate2.22.json): met the SLO (TTFT p99 0.353 s, E2E p99 6.363 s)" in \
        text_of(render(plan), width=160)
    tight = plan_files([*RECORDED, *opened], qps=20, slo="ttft=1,e2e=6", headroom=20)
    assert tight.concurrency == 16 and tight.boxes == 9
    assert [why for _, why in tight.open_loop] == ["E2E p99 6.74 s > 6 s", "E2E p99 6.36 s > 6 s"]
    assert any("an open loop at λ / N or less missed the SLO" in n for n in tight.notes)
    more = plan_files([*RECORDED, *opened], qps=20, slo="ttft=1,e2e=6", headroom=50)
    assert (more.boxes, more.replicas) == (11, 12) and more.verify_rate == pytest.approx(1.818, abs=5e-4)
    assert any("an open loop at λ / N or less missed the SLO" in n for n in more.notes)


def test_recorded_sweep_obeys_littles_law() -> None:
    """What justifies W = mean e2e: in a closed loop of c requests, Little's law says the box's
    throughput is c / W; the recorded runs measured that within 1 % at every concurrency."""
    summaries = recorded_summaries()
    assert sorted(summaries) == [1, 2, 4, 8, 16, 32]
    for c, s in summaries.items():
        assert s["failed"] == 0
        assert c / s["e2e"]["mean"] == pytest.approx(s["request_throughput"], rel=0.01), c


# ------------------------------------------------------------------------------------ bad inputs


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "160"})


def test_cli_plan(hand_file: Path) -> None:
    result = invoke(str(hand_file), "--qps", "5", "--slo", "ttft=1", "--headroom", "20")
    assert result.exit_code == 0, result.output
    assert "replicas = N + 1 = 3 + 1 = 4" in result.output and "13.33 per replica" in result.output
    result = invoke(str(hand_file), "--qps", "5", "--slo", "ttft=1", "--headroom", "20", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["little"]["replicas"] == 4


BAD_FILES = {  # case -> (file contents, or None for no file; the one-line message)
    "missing": (None, "cannot read"),
    "empty": ("", "is empty"),
    "not json": ("{runs", "is not JSON"),
    "no runs": (json.dumps({"tool": "inferd bench", "runs": []}), "is not an `inferd bench --json` result (no runs)"),
    "other tool": (json.dumps({**HAND, "tool": "vllm"}), "is not an `inferd bench --json` result (its \"tool\" is 'vllm')"),
    "no summary": (json.dumps({**HAND, "runs": [{"concurrency": 1, "summary": None}]}), "a run without latency summaries"),
    "open loop only": (json.dumps({**HAND, "runs": [{**HAND["runs"][0], "rate": 2.0}]}), "no closed-loop runs in"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_files(tmp_path: Path, case: str) -> None:
    contents, message = BAD_FILES[case]
    path = tmp_path / "bad.json"
    if contents is not None:
        path.write_text(contents)
    assert_fails(invoke(str(path), "--qps", "5", "--slo", "ttft=1"), message)
    with pytest.raises(PlanError, match="bad.json"):
        plan_files([path], qps=5, slo="ttft=1")


BAD_OPTIONS = {  # case -> (options, the one-line message)
    "never met": (["--qps", "5", "--slo", "ttft=0.1"],
                  "no run met the SLO (TTFT p99 ≤ 0.1 s); lowest concurrency 1: TTFT p99 0.25 s > 0.1 s"),
    "qps 0": (["--qps", "0", "--slo", "ttft=1"], "--qps must be > 0 requests/s, got 0"),
    "qps < 0": (["--qps", "-3", "--slo", "ttft=1"], "--qps must be > 0 requests/s, got -3"),
    "no slo": (["--qps", "5"], "give a latency SLO"),
    "bad slo": (["--qps", "5", "--slo", "ttft"], "--slo takes KEY=SECONDS pairs"),
    "percentile": (["--qps", "5", "--slo", "ttft=1", "--percentile", "98"], "--percentile is one of 50, 90, 95, 99, got 98"),
    "headroom": (["--qps", "5", "--slo", "ttft=1", "--headroom", "-5"], "--headroom is a percentage in [0, 1000), got -5"),
    "spare": (["--qps", "5", "--slo", "ttft=1", "--spare", "-1"], "--spare must be ≥ 0, got -1"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_bad_options(hand_file: Path, case: str) -> None:
    options, message = BAD_OPTIONS[case]
    assert_fails(invoke(str(hand_file), *options), message)


def test_files_of_two_models(tmp_path: Path, hand_file: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps(result_of(*HAND["runs"], model="llama")))
    assert_fails(invoke(str(hand_file), str(other), "--qps", "5", "--slo", "ttft=1"),
                 "the files measure different models (llama, m): plan one box at a time")


def assert_fails(result: Any, message: str) -> None:
    """Exit status 1 and one line, `inferd: error: ...` with `message` in it; no traceback."""
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("inferd: error: ") and message in lines[0], result.output


def test_cli_process_exit_status(tmp_path: Path) -> None:
    """The real process: one line on stderr, a non-zero status, nothing on stdout."""
    empty = tmp_path / "empty.json"
    empty.write_text("")
    proc = subprocess.run([sys.executable, "-m", "inferd.cli", "plan", str(empty), "--qps", "5", "--slo", "ttft=1"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == f"inferd: error: {empty} is empty"
