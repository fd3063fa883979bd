"""`inferd status`: a live terminal dashboard of a running server, over HTTP only.

    fetch(url)  ->  snapshot: the JSON of GET /v1/status, a plain dict
    render(snapshot, now)  ->  one frame, a pure function of its arguments
    run(...)  ->  fetch, render, `Live.update`, every `interval` seconds

The frame is laid out in named regions, top to bottom:

    header      model, device, dtype, version, uptime, state
    queues      one row per priority class: queue, running, KV blocks, TTFT against its target
    kv          KV blocks used / cached / free, prefix-cache hit rate, device memory
    throughput  generation tok/s over the last minute, as a sparkline
    requests    the running and waiting requests  |  counters: preemptions, timeouts, ...

Fields a server does not send (older servers lack state, history, requests, limits) show as
"-", so every region renders against any version of /v1/status.
"""

from __future__ import annotations

import json
import math
import os
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

DEFAULT_URL = "http://127.0.0.1:8000"
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60  # one character per history value: a minute at the server's 1 s resolution
MISSING = "-"
_STATE_STYLES = {"ready": "bold green", "loading": "bold yellow", "draining": "bold yellow", "not_ready": "bold red"}
_REQUEST_STYLES = {"running": "green", "waiting": "yellow", "swapped": "magenta"}


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
    return Group(
        _header(snapshot, now),
        _queues(snapshot),
        _side_by_side((_kv(snapshot), 2), (_throughput(snapshot), 3)),
        _side_by_side((_requests(snapshot, max_requests), 3), (_counters(snapshot), 2)),
    )


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
        ("up ", "dim"), _dur(s.get("uptime_seconds")), "  ",
        (str(state or MISSING), _STATE_STYLES.get(str(state), "")),
    )
    line2 = Text.assemble(
        ("running ", "dim"), _int(s.get("running")), "  ",
        ("waiting ", "dim"), _int(s.get("waiting")), "  ",
        ("steps ", "dim"), _int(s.get("steps")), "  ",
        ("max_model_len ", "dim"), _int(s.get("max_model_len")), "  ",
        ("updated ", "dim"), time.strftime("%H:%M:%S", time.localtime(now)),
    )
    return Panel(Group(line1, line2), title="inferd status", title_align="left", box=box.ROUNDED)


def _queues(s: dict[str, Any]) -> RenderableType:
    table = _table()
    classes = _dicts(s.get("classes"))
    widest = max((len(str(c.get("name", MISSING))) for c in classes), default=1)
    table.add_column("class", style="bold", no_wrap=True, min_width=widest)
    for name in ("prio", "waiting", "queued tok", "oldest", "running", "KV blk", "TTFT p50", "p95",
                 "target", "timeouts", "rejected"):
        table.add_column(name, justify="right")
    for c in classes:
        limits = c.get("limits") if isinstance(c.get("limits"), dict) else {}
        target, p95 = limits.get("ttft_target"), c.get("ttft_p95_seconds")
        late = _is_num(target) and _is_num(p95) and p95 > target
        table.add_row(
            str(c.get("name", MISSING)), _int(c.get("priority")), _int(c.get("waiting")),
            _int(c.get("queued_tokens")), _dur(c.get("oldest_wait_seconds")), _int(c.get("running")),
            _int(c.get("kv_blocks_used")), _dur(c.get("ttft_p50_seconds")),
            Text(_dur(p95), style="bold red" if late else ""), _dur(target),
            _total(c.get("timeouts")), _total(c.get("rejections")),
        )
    return Panel(table, title="queues", title_align="left", box=box.ROUNDED)


def _kv(s: dict[str, Any]) -> RenderableType:
    total, used, cached = s.get("kv_blocks_total"), s.get("kv_blocks_used"), s.get("kv_blocks_cached")
    lines: list[RenderableType] = []
    style = "green"
    if _is_num(total) and total > 0 and _is_num(used):
        ratio = s.get("kv_usage_ratio") if _is_num(s.get("kv_usage_ratio")) else used / total
        style = "red" if ratio > 0.9 else "yellow" if ratio > 0.7 else "green"
        lines.append(_Bar(total, [(used, style), (cached if _is_num(cached) else 0, "blue")]))
        usage = f"{used} / {total} blocks used ({ratio:.1%})"
    else:
        usage = f"{_int(used)} / {_int(total)} blocks used"
    queries, hits = s.get("prefix_cache_queries"), s.get("prefix_cache_hits")
    rate = MISSING
    if _is_num(queries) and queries > 0 and _is_num(hits):
        rate = f"{hits / queries:.0%} ({hits} / {queries})"
    lines.append(Text.assemble(("■ ", style), usage))
    lines.append(Text.assemble(("■ ", "blue"), f"{_int(cached)} cached, evictable"))
    lines.append(Text.assemble(("prefix-cache hit rate ", "dim"), rate))
    memory = s.get("device_memory")
    if isinstance(memory, dict) and _is_num(memory.get("used_bytes")) and _is_num(memory.get("total_bytes")):
        u, t = memory["used_bytes"], memory["total_bytes"]
        share = f" ({u / t:.0%})" if t > 0 else ""
        lines.append(Text.assemble(("device memory ", "dim"), f"{_bytes(u)} / {_bytes(t)}{share}"))
    return Panel(Group(*lines), title="KV cache", title_align="left", box=box.ROUNDED)


def _throughput(s: dict[str, Any]) -> RenderableType:
    tp = s.get("throughput") if isinstance(s.get("throughput"), dict) else {}
    history = [v for v in tp.get("history") if _is_num(v)] if isinstance(tp.get("history"), list) else []
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


def _requests(s: dict[str, Any], max_requests: int | None) -> RenderableType:
    requests = s.get("requests")
    if not isinstance(requests, list):
        return Panel(Text(MISSING), title="requests", title_align="left", box=box.ROUNDED)
    # running first, then the oldest: the ones to look at when something is stuck
    order = {"running": 0, "swapped": 1, "waiting": 2}
    rows = sorted(_dicts(requests), key=lambda r: (order.get(str(r.get("state")), 3), -_num(r.get("age_seconds"))))
    shown = rows if max_requests is None else rows[:max(0, max_requests)]
    table = _table()
    table.add_column("id", justify="right")
    widest = max((len(str(r.get("class", MISSING))) for r in shown), default=1)
    table.add_column("class", no_wrap=True, min_width=widest)
    table.add_column("state")
    for name in ("age", "tokens in/out", "TTFT"):
        table.add_column(name, justify="right")
    for r in shown:
        state = str(r.get("state", MISSING))
        table.add_row(
            _int(r.get("id")), str(r.get("class", MISSING)), Text(state, style=_REQUEST_STYLES.get(state, "")),
            _dur(r.get("age_seconds")), f"{_int(r.get('prompt_tokens'))} / {_int(r.get('output_tokens'))}",
            _dur(r.get("ttft_seconds")),
        )
    title = f"requests ({len(rows)})"
    if len(shown) < len(rows):
        title += f", {len(rows) - len(shown)} not shown"
    return Panel(table, title=title, title_align="left", box=box.ROUNDED)


def _counters(s: dict[str, Any]) -> RenderableType:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    misses: dict[str, int] = {}
    for c in _dicts(s.get("classes")):
        deadline_misses = c.get("deadline_misses")
        for kind, n in (deadline_misses.items() if isinstance(deadline_misses, dict) else ()):
            misses[kind] = misses.get(kind, 0) + int(_num(n))
    shed = s.get("shed_level")
    shed_text = Text(_int(shed), style="bold red" if _is_num(shed) and shed > 0 else "")
    if isinstance(s.get("shed_actions"), dict) and s["shed_actions"]:
        shed_text.append(f" ({_counts(s['shed_actions'])})", style="dim")
    grid.add_row("preemptions", _counts(s.get("preemptions")))
    grid.add_row("timeouts", _counts(s.get("timeouts")))
    grid.add_row("rejections", _counts(s.get("rejections")))
    grid.add_row("deadline misses", _counts(misses) if _dicts(s.get("classes")) else MISSING)
    grid.add_row("shed level", shed_text)
    return Panel(grid, title="counters", title_align="left", box=box.ROUNDED)


def _table() -> Table:
    # NOTE: one space of padding, one of separator: twelve columns fit an 80-column pane's
    # worth of data in 120 columns without truncating class names
    return Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))


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


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: Any) -> float:
    return float(v) if _is_num(v) else 0.0


def _int(v: Any) -> str:
    return str(int(v)) if _is_num(v) else MISSING


def _dur(v: Any) -> str:
    """Seconds, human-sized: 110ms, 1.2s, 3m05s, 2h07m."""
    if not _is_num(v):
        return MISSING
    if v < 1:
        return f"{v * 1000:.0f}ms"
    if v < 60:
        return f"{v:.1f}s"
    if v < 3600:
        return f"{int(v // 60)}m{int(v % 60):02d}s"
    return f"{int(v // 3600)}h{int(v % 3600 // 60):02d}m"


def _rate(v: Any) -> str:
    return f"{v:.1f} tok/s" if _is_num(v) else MISSING


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _dicts(v: Any) -> list[dict[str, Any]]:
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _counts(d: Any) -> str:
    """{"recompute": 3, "swap": 1} -> "recompute 3, swap 1"; {} -> "0"; absent -> "-"."""
    if not isinstance(d, dict):
        return MISSING
    items = [f"{k} {int(n)}" for k, n in sorted(d.items()) if _is_num(n) and n]
    return ", ".join(items) or "0"


def _total(d: Any) -> str:
    if not isinstance(d, dict):
        return MISSING
    return str(sum(int(n) for n in d.values() if _is_num(n)))


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
        classes = _dicts(snapshot.get("classes"))
        gen = sum(_num(c.get("generation_tokens")) for c in classes)
        prompt = sum(_num(c.get("prompt_tokens")) for c in classes)
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
    # NOTE: the other regions take 19 lines plus one per class (at 100+ columns); the request
    # table gets the rest of the screen, so the frame does not overflow it (Live crops the bottom)
    return max(1, console.height - 21 - len(_dicts(snapshot.get("classes"))))


def run(url: str = DEFAULT_URL, interval: float = 1.0, once: bool = False, api_key: str | None = None) -> None:
    """Poll and draw until interrupted (or once). StatusError when the first poll fails; later
    failures keep the last frame on screen under a red line and are retried."""
    from rich.live import Live

    api_key = api_key or os.environ.get("INFERD_API_KEY") or None
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
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
