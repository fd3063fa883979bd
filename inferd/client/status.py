"""`inferd status`: a live terminal dashboard of a running server, over HTTP only.

    fetch(url)  ->  snapshot: the JSON of GET /v1/status, a plain dict
    render(snapshot, now)  ->  one frame, a pure function of its arguments
    run(...)  ->  fetch, render, `Live.update`, every `interval` seconds

The frame is laid out in named regions, top to bottom:

    header      model, device, dtype, version, uptime, state
    models      one row per served model: revision, health or degradation, functional level, load,
                reloads, cascade savings; then the routes and their shares (only when the server
                serves more than one model or has routes)
    queues      one row per priority class: queue, running, KV blocks, TTFT against its target
    tenants     one row per tenant: weight, queue, use, fair-share clock, latency, rate-limit room
                (only when the server sends tenants)
    kv          KV blocks used / cached / free, prefix-cache hit rate, device memory
    throughput  generation tok/s over the last minute, as a sparkline
    requests    the running and waiting requests  |  counters: preemptions, timeouts, ...
    drift       PSI per feature against the baseline, the window's means (only with [request_log])

Fields a server does not send (older servers lack state, history, requests, limits, tenants, models)
show as "-", so every region renders against any version of /v1/status. The table regions and
the formatting shared by all regions live in `status_panels`.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from inferd.client.status_panels import (MISSING, counters, dicts, drift, fmt_dur, fmt_int, is_num, models,
                                         models_lines, num, queues, requests, tenants)
from inferd.settings import environment

DEFAULT_URL = "http://127.0.0.1:8000"
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60  # one character per history value: a minute at the server's 1 s resolution
_STATE_STYLES = {"ready": "bold green", "loading": "bold yellow", "draining": "bold yellow", "not_ready": "bold red"}


class StatusError(Exception):
    """The server could not be reached or refused the request; the message is one clear line."""


# ------------------------------------------------------------------------------------ fetch


def status_url(url: str) -> str:
    """The /v1/status address of a server given as `host:port`, a base URL, or .../v1."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    if url.endswith("/v1/status"):
        return url
    return f"{url}/status" if url.endswith("/v1") else f"{url}/v1/status"


def fetch(url: str, api_key: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """GET the server's /v1/status as a dict; StatusError with a one-line reason otherwise."""
    target = status_url(url)
    headers = {"Accept": "application/json", "User-Agent": "inferd-status"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(target, headers=headers), timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        raise StatusError(_http_error(target, e, api_key)) from None
    except urllib.error.URLError as e:
        reason = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else e.reason
        raise StatusError(f"cannot reach {target}: {reason} (is `inferd serve` running there?)") from None
    except TimeoutError:
        raise StatusError(f"no answer from {target} within {timeout:g} s") from None
    except (OSError, ValueError) as e:  # a reset connection, a malformed URL
        raise StatusError(f"cannot reach {target}: {e}") from None
    try:
        snapshot = json.loads(body)
    except ValueError:
        snapshot = None
    if not isinstance(snapshot, dict):
        raise StatusError(f"{target} did not answer with a JSON object (is it an inferd server?)")
    return snapshot


def _http_error(target: str, e: urllib.error.HTTPError, api_key: str | None) -> str:
    try:
        message = json.loads(e.read())["error"]["message"]
    except Exception:  # any body at all: the status code alone still says enough
        message = e.reason
    if e.code in (401, 403):
        if not api_key:
            return f"{target} needs an API key ({message}): pass --api-key KEY or set INFERD_API_KEY"
        return f"{target} rejected the API key ({message})"
    if e.code == 404:
        return f"{target} not found (HTTP 404): is it an inferd server?"
    return f"{target} answered HTTP {e.code}: {message}"


# ----------------------------------------------------------------------------------- render


def render(snapshot: dict[str, Any], now: float | None = None, max_requests: int | None = None) -> RenderableType:
    """One dashboard frame for a /v1/status snapshot; `now` (epoch seconds) stamps the header.

    `max_requests` caps the request table (running requests first, then the oldest); None
    shows them all.
    """
    now = time.time() if now is None else now
    regions = (
        _header(snapshot, now),
        models(snapshot),
        queues(snapshot),
        tenants(snapshot),
        _side_by_side((_kv(snapshot), 2), (_throughput(snapshot), 3)),
        _side_by_side((requests(snapshot, max_requests), 3), (counters(snapshot), 2)),
        drift(snapshot),
    )
    return Group(*(region for region in regions if region is not None))


def _side_by_side(*regions: tuple[RenderableType, int]) -> RenderableType:
    """Regions in one row, each `ratio` parts of the width."""
    grid = Table.grid(expand=True, padding=(0, 1))
    for _, ratio in regions:
        grid.add_column(ratio=ratio)
    grid.add_row(*(region for region, _ in regions))
    return grid


def _header(s: dict[str, Any], now: float) -> RenderableType:
    state = s.get("state")
    line1 = Text.assemble(
        (str(s.get("model", MISSING)), "bold cyan"), "  ",
        ("device ", "dim"), str(s.get("device") or MISSING), "  ",
        ("dtype ", "dim"), str(s.get("dtype") or MISSING), "  ",
        ("inferd ", "dim"), str(s.get("version") or MISSING), "  ",
        ("up ", "dim"), fmt_dur(s.get("uptime_seconds")), "  ",
        (str(state or MISSING), _STATE_STYLES.get(str(state), "")),
    )
    line2 = Text.assemble(
        ("running ", "dim"), fmt_int(s.get("running")), "  ",
        ("waiting ", "dim"), fmt_int(s.get("waiting")), "  ",
        ("steps ", "dim"), fmt_int(s.get("steps")), "  ",
        ("max_model_len ", "dim"), fmt_int(s.get("max_model_len")), "  ",
        ("updated ", "dim"), time.strftime("%H:%M:%S", time.localtime(now)),
    )
    return Panel(Group(line1, line2), title="inferd status", title_align="left", box=box.ROUNDED)


def _kv(s: dict[str, Any]) -> RenderableType:
    total, used, cached = s.get("kv_blocks_total"), s.get("kv_blocks_used"), s.get("kv_blocks_cached")
    lines: list[RenderableType] = []
    style = "green"
    if is_num(total) and total > 0 and is_num(used):
        ratio = s.get("kv_usage_ratio") if is_num(s.get("kv_usage_ratio")) else used / total
        style = "red" if ratio > 0.9 else "yellow" if ratio > 0.7 else "green"
        lines.append(_Bar(total, [(used, style), (cached if is_num(cached) else 0, "blue")]))
        usage = f"{used} / {total} blocks used ({ratio:.1%})"
    else:
        usage = f"{fmt_int(used)} / {fmt_int(total)} blocks used"
    queries, hits = s.get("prefix_cache_queries"), s.get("prefix_cache_hits")
    rate = MISSING
    if is_num(queries) and queries > 0 and is_num(hits):
        rate = f"{hits / queries:.0%} ({hits} / {queries})"
    lines.append(Text.assemble(("■ ", style), usage))
    lines.append(Text.assemble(("■ ", "blue"), f"{fmt_int(cached)} cached, evictable"))
    lines.append(Text.assemble(("prefix-cache hit rate ", "dim"), rate))
    state = s.get("state_slots")
    if isinstance(state, dict) and is_num(state.get("total")):  # a hybrid model's linear-attention state
        lines.append(Text.assemble(("state slots ", "dim"), f"{fmt_int(state.get('working'))} working, "
                                   f"{fmt_int(state.get('checkpoints'))} checkpoints "
                                   f"({_bytes(state.get('checkpoint_bytes') or 0)}) of {fmt_int(state['total'])}, "
                                   f"{fmt_int(state.get('checkpoint_hits'))} hits"))
    tiers = s.get("cache_tiers")
    if isinstance(tiers, dict) and is_num(tiers.get("sessions")):
        host = (f"host tier {fmt_int(tiers.get('host_blocks_used'))} / {fmt_int(tiers.get('host_blocks_total'))} blocks, "
                f"{fmt_int(tiers.get('host_hit_tokens'))} tokens served; " if tiers.get("host_blocks_total") else "")
        lines.append(Text.assemble(("tiers ", "dim"), f"{host}{fmt_int(tiers['sessions'])} sessions holding "
                                   f"{fmt_int(tiers.get('session_blocks'))} blocks"))
    spec = s.get("speculation")
    if isinstance(spec, dict) and spec.get("method") not in (None, "off") and is_num(spec.get("drafted_tokens")):
        drafted, accepted = spec["drafted_tokens"], spec.get("accepted_tokens") or 0
        share = f" ({accepted / drafted:.0%})" if drafted else ""
        lines.append(Text.assemble(("speculation ", "dim"), f"{spec['method']}: {fmt_int(accepted)} of "
                                   f"{fmt_int(drafted)} drafts accepted{share}"))
    memory = s.get("device_memory")
    if isinstance(memory, dict) and is_num(memory.get("used_bytes")) and is_num(memory.get("total_bytes")):
        u, t = memory["used_bytes"], memory["total_bytes"]
        share = f" ({u / t:.0%})" if t > 0 else ""
        lines.append(Text.assemble(("device memory ", "dim"), f"{_bytes(u)} / {_bytes(t)}{share}"))
    return Panel(Group(*lines), title="KV cache", title_align="left", box=box.ROUNDED)


def _throughput(s: dict[str, Any]) -> RenderableType:
    tp = s.get("throughput") if isinstance(s.get("throughput"), dict) else {}
    history = [v for v in tp.get("history") if is_num(v)] if isinstance(tp.get("history"), list) else []
    line: RenderableType = _Spark(history) if history else Text(MISSING)
    rates = Text.assemble(
        ("generation ", "dim"), _rate(tp.get("generation_tokens_per_second")), "   ",
        ("prompt ", "dim"), _rate(tp.get("prompt_tokens_per_second")),
    )
    peak = Text.assemble(("peak ", "dim"), _rate(max(history[-SPARK_WIDTH:])) if history else MISSING)
    return Panel(Group(line, rates, peak), title="generation tok/s, last minute", title_align="left", box=box.ROUNDED)


def sparkline(values: Iterable[float], width: int = SPARK_WIDTH) -> str:
    """The last `width` values as block characters, scaled to their maximum (zero is the floor)."""
    tail = [max(0.0, float(v)) for v in values][-width:]
    top = max(tail, default=0.0)
    if top <= 0:
        return SPARK[0] * len(tail)
    steps = len(SPARK) - 1
    return "".join(SPARK[0] if v <= 0 else SPARK[min(steps, max(1, math.ceil(v / top * steps)))] for v in tail)


@dataclass
class _Spark:
    """The sparkline of the newest values that fit its region, newest at the right edge."""

    values: list[float]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(1, min(SPARK_WIDTH, options.max_width))
        yield Text(sparkline(self.values, width).rjust(width), style="cyan")


@dataclass
class _Bar:
    """A stacked horizontal bar as wide as its region: one coloured run per (count, style), then free."""

    total: float
    parts: list[tuple[float, str]] = field(default_factory=list)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(1, options.max_width)
        bar, filled = Text(), 0
        for count, style in self.parts:
            n = min(width - filled, round(max(0.0, count) / self.total * width))
            if count > 0:
                n = max(n, 1 if filled < width else 0)  # a non-zero share never vanishes
            bar.append("█" * n, style=style)
            filled += n
        bar.append("░" * (width - filled), style="dim")
        yield bar


# ------------------------------------------------------------------------------ formatting


def _rate(v: Any) -> str:
    return f"{v:.1f} tok/s" if is_num(v) else MISSING


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


# -------------------------------------------------------------------------------------- run


class LocalThroughput:
    """Generation and prompt tok/s measured between polls, for servers that send no history."""

    def __init__(self, interval: float) -> None:
        self.history: deque[float] = deque(maxlen=max(1, math.ceil(60 / interval)))
        self._last: tuple[float, float, float] | None = None  # (time, generation, prompt tokens)
        self._prompt_rate: float | None = None

    def fill(self, snapshot: dict[str, Any], now: float) -> dict[str, Any]:
        """The snapshot, with a client-side `throughput` added when the server sent none."""
        tp = snapshot.get("throughput")
        if isinstance(tp, dict) and isinstance(tp.get("history"), list):
            return snapshot
        classes = dicts(snapshot.get("classes"))
        gen = sum(num(c.get("generation_tokens")) for c in classes)
        prompt = sum(num(c.get("prompt_tokens")) for c in classes)
        if self._last is not None and now > self._last[0] and gen >= self._last[1]:
            dt = now - self._last[0]
            self.history.append((gen - self._last[1]) / dt)
            self._prompt_rate = max(0.0, prompt - self._last[2]) / dt
        self._last = (now, gen, prompt)
        rate = self.history[-1] if self.history else None
        return {**snapshot, "throughput": {
            "generation_tokens_per_second": rate, "prompt_tokens_per_second": self._prompt_rate,
            "history": list(self.history),
        }}


def _request_rows(console: Console, snapshot: dict[str, Any]) -> int:
    # NOTE: the other regions take 19 lines plus one per class, and 4 plus one per tenant when
    # there are tenants (at 100+ columns), and the models region's own height; the request table
    # gets the rest of the screen, so the frame does not overflow it (Live crops the bottom)
    n_tenants = len(dicts(snapshot.get("tenants")))
    n_drift = 4 if isinstance(snapshot.get("drift"), dict) else 0  # its panel: two lines and the frame
    return max(1, console.height - 21 - len(dicts(snapshot.get("classes"))) - (4 + n_tenants if n_tenants else 0)
               - n_drift - models_lines(snapshot))


def run(url: str = DEFAULT_URL, interval: float = 1.0, once: bool = False, api_key: str | None = None) -> None:
    """Poll and draw until interrupted (or once). StatusError when the first poll fails; later
    failures keep the last frame on screen under a red line and are retried."""
    from rich.live import Live

    api_key = api_key or environment.API_KEY.get()
    console = Console()
    if not console.is_terminal and environment.COLUMNS.get() is None:
        console.width = 120  # NOTE: rich's 80 columns for a pipe would wrap the queue table
    tracker = LocalThroughput(interval)
    timeout = max(2.0, interval * 2)
    snapshot = tracker.fill(fetch(url, api_key, timeout), time.monotonic())
    fetched_at = time.time()
    if once:
        console.print(render(snapshot, fetched_at))
        return
    try:
        with Live(render(snapshot, fetched_at, _request_rows(console, snapshot)), console=console,
                  screen=True, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                frame: RenderableType
                try:
                    snapshot = tracker.fill(fetch(url, api_key, timeout), time.monotonic())
                    fetched_at = time.time()
                    frame = render(snapshot, fetched_at, _request_rows(console, snapshot))
                except StatusError as e:  # the last good frame, its "updated" time showing its age
                    stale = render(snapshot, fetched_at, _request_rows(console, snapshot) - 1)
                    frame = Group(Text(f"{e} (retrying every {interval:g} s)", style="bold red"), stale)
                live.update(frame, refresh=True)
    except KeyboardInterrupt:
        pass
