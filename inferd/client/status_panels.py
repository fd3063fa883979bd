"""The table regions of `inferd status` and the formatting they share with the rest of the frame.

Each region is a pure function of the /v1/status snapshot (a plain dict) to a rich renderable:

    models(s)                 one row per served model, then the routes; None for one model and no routes
    queues(s)                 one row per priority class
    tenants(s)                one row per tenant; None when the server sends no tenants
    requests(s, max_requests) the running and waiting requests
    counters(s)               preemptions, timeouts, rejections, deadline misses, shed level
    drift(s)                  PSI per feature and the window's means; None when the server sends none

Fields a server does not send render as MISSING ("-").
"""

from __future__ import annotations

import math
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

MISSING = "-"
LOOP_LAG_SHOWN = 0.05  # seconds: the event loop's lag is shown from here on (it is the server's own)
_REQUEST_STYLES = {"running": "green", "waiting": "yellow", "swapped": "magenta"}
_FEATURE_NAMES = {"prompt_tokens": "prompt len", "completion_tokens": "output len", "finish_reason": "finish"}
_LEVEL_STYLES = {"normal": "", "whole": "yellow", "capped": "yellow", "refuse_lowest": "bold red"}
_PROBE_ERROR_WIDTH = 40  # a probe error can be a whole traceback line: its start says enough
_MODEL_WIDTH, _HEALTH_WIDTH = 30, 16  # the most "name@revision (aliases)" takes; the least health gets


# ---------------------------------------------------------------------------------- regions


def queues(s: dict[str, Any]) -> RenderableType:
    t = table()
    classes = dicts(s.get("classes"))
    widest = max((len(str(c.get("name", MISSING))) for c in classes), default=1)
    t.add_column("class", style="bold", no_wrap=True, min_width=widest)
    for name in ("prio", "waiting", "queued tok", "oldest", "running", "KV blk", "TTFT p50", "p95",
                 "target", "timeouts", "rejected"):
        t.add_column(name, justify="right")
    for c in classes:
        limits = c.get("limits") if isinstance(c.get("limits"), dict) else {}
        target, p95 = limits.get("ttft_target"), c.get("ttft_p95_seconds")
        late = is_num(target) and is_num(p95) and p95 > target
        t.add_row(
            str(c.get("name", MISSING)), fmt_int(c.get("priority")), fmt_int(c.get("waiting")),
            fmt_int(c.get("queued_tokens")), fmt_dur(c.get("oldest_wait_seconds")), fmt_int(c.get("running")),
            fmt_int(c.get("kv_blocks_used")), fmt_dur(c.get("ttft_p50_seconds")),
            Text(fmt_dur(p95), style="bold red" if late else ""), fmt_dur(target),
            fmt_total(c.get("timeouts")), fmt_total(c.get("rejections")),
        )
    return Panel(t, title="queues", title_align="left", box=box.ROUNDED)


def tenants(s: dict[str, Any]) -> RenderableType | None:
    """One row per tenant, in the server's order; None (no region) when there are none."""
    rows = dicts(s.get("tenants"))
    if not rows:
        return None
    t = table()
    widest = max(len(str(r.get("name", MISSING))) for r in rows)
    t.add_column("tenant", style="bold", no_wrap=True, min_width=widest)
    t.add_column("tier", no_wrap=True)
    # vtok: tokens served / weight, the fair-share clock (the least goes first); TTFT and TPOT:
    # p50s; left: what the tenant's rate-limit buckets hold now. NOTE: short headers, so fifteen
    # columns fit 120 with room for tenant names
    for name in ("weight", "wait", "run", "reqs", "tok in", "tok out", "vtok", "TTFT", "p95", "TPOT", "rej",
                 "req left", "tok left"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        rejected = fmt_total(r.get("rejections"))
        t.add_row(
            str(r.get("name", MISSING)), str(r.get("tier") or MISSING),
            f"{r['weight']:g}" if is_num(r.get("weight")) else MISSING,
            fmt_int(r.get("waiting")), fmt_int(r.get("running")), fmt_count(r.get("requests")),
            fmt_count(r.get("prompt_tokens")), fmt_count(r.get("completion_tokens")),
            fmt_count(r.get("virtual_tokens")), fmt_dur(r.get("ttft_p50_seconds")),
            fmt_dur(r.get("ttft_p95_seconds")), fmt_dur(r.get("tpot_p50_seconds")),
            Text(rejected, style="yellow" if rejected not in (MISSING, "0") else ""),
            fmt_count(r.get("remaining_requests")), fmt_count(r.get("remaining_tokens")),
        )
    # (a line under the table, not a sixteenth column: only while some tenant has given seats)
    gave = [(str(r.get("name", MISSING)), r["fair_preemptions"]) for r in rows
            if is_num(r.get("fair_preemptions")) and r["fair_preemptions"] > 0]
    body: RenderableType = t
    if gave:
        body = Group(t, Text("seats given to tenants below their fair share: "
                             + ", ".join(f"{name} {fmt_count(n)}" for name, n in gave), style="dim"))
    return Panel(body, title=f"tenants ({len(rows)})", title_align="left", box=box.ROUNDED)


def models(s: dict[str, Any]) -> RenderableType | None:
    """One row per served model, then one line per route; None (no region) for a server with one
    model and no routes (or one too old to send them), whose header already says it all."""
    served = _served_models(s)
    if served is None:
        return None
    rows, routes = served
    parts: list[RenderableType] = []
    if rows:
        t = table()
        # NOTE: no column wraps, so the panel is exactly models_lines(s) high; health takes the
        # width the others leave, and a long alias list or probe error ends in an ellipsis
        t.add_column("model", no_wrap=True, overflow="ellipsis", max_width=_MODEL_WIDTH)
        t.add_column("health", no_wrap=True, overflow="ellipsis", ratio=1, width=_HEALTH_WIDTH)
        t.add_column("level", no_wrap=True)
        # reload/ref: reloads done / refused (the new revision failed its checks); esc/saved: a
        # cascade's small model: answers escalated to the large one / large-model tokens saved
        # emb/score: pooling requests answered (/v1/embeddings; /v1/rerank and /v1/score), apart from reqs
        # load/sw (models on demand only): loads (on demand, wakes from level 2) / of which unloaded
        # another model to make room
        on_demand = any(_life(m).get("load") == "on_demand" or _life(m).get("loads") for m in rows)
        for name in ("run/wait", "KV blk", "reqs", "emb/score", "fallbk", "reload/ref", "esc/saved",
                     *(("load/sw",) if on_demand else ())):
            t.add_column(name, justify="right", no_wrap=True)
        for m in rows:
            level = str(m.get("functional_level") or MISSING)
            refused = m.get("reloads_refused")
            t.add_row(
                _model_name(m), _health(m), Text(level, style=_LEVEL_STYLES.get(level, "yellow")),
                f"{fmt_int(m.get('running'))}/{fmt_int(m.get('waiting'))}",
                f"{fmt_int(m.get('kv_blocks_used'))}/{fmt_int(m.get('kv_blocks_total'))}",
                fmt_count(m.get("requests")), _pooling(m.get("pooling")), fmt_count(m.get("fallbacks")),
                Text.assemble(f"{fmt_int(m.get('reloads'))}/",
                              (fmt_int(refused), "yellow" if is_num(refused) and refused > 0 else "")),
                f"{fmt_count(m.get('escalations'))}/{fmt_count(m.get('tokens_saved'))}",
                *((f"{fmt_count(_life(m).get('loads'))}/{fmt_count(_life(m).get('switches'))}",) if on_demand else ()),
            )
        parts.append(t)
    if routes:
        parts.append(_routes(routes))
    return Panel(Group(*parts), title=f"models ({len(rows)})", title_align="left", box=box.ROUNDED)


def _pooling(counts: Any) -> str:
    """Embedding / score requests answered ("-" from a server that does not count them)."""
    if not isinstance(counts, dict):
        return MISSING
    return "/".join(fmt_count((counts.get(task) or {}).get("requests")) for task in ("embed", "score"))


def models_lines(s: dict[str, Any]) -> int:
    """The height of the models region: 0 when there is none."""
    served = _served_models(s)
    if served is None:
        return 0
    rows, routes = served
    return 2 + (2 + len(rows) if rows else 0) + len(routes)  # frame, header and its rule, rows, routes


def _served_models(s: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """The models and routes to show; None for one model and no routes, which the header covers."""
    rows, routes = dicts(s.get("models")), dicts(s.get("routes"))
    return None if len(rows) < 2 and not routes else (rows, routes)


def _model_name(m: dict[str, Any]) -> Text:
    """name@revision, then its aliases."""
    text = Text(str(m.get("name", MISSING)), style="bold")
    if m.get("revision"):
        text.append(f"@{m['revision']}")
    aliases = [str(a) for a in m["aliases"] if a] if isinstance(m.get("aliases"), list) else []
    if aliases:
        text.append(f" ({', '.join(aliases)})", style="dim")
    if m.get("experts"):
        text.append(f" · MoE, {m['experts']}", style="dim")
    return text


def _life(m: dict[str, Any]) -> dict[str, Any]:
    life = m.get("life")
    return life if isinstance(life, dict) else {}


_STATE_STYLES = {"loading": "yellow", "waking": "yellow", "unloading": "yellow", "asleep": "blue",
                 "unloaded": "dim", "failed": "bold red"}


def _health(m: dict[str, Any]) -> Text:
    """A model not serving: its state (asleep's level, failed's reason); else degraded (where its
    requests go now) over unhealthy (the probe's error) over ok."""
    state = m.get("state")
    if isinstance(state, str) and state != "serving":
        life = _life(m)
        text = state
        if state == "asleep" and life.get("sleep_level"):
            text += f" (level {life['sleep_level']})"
        if state == "failed" and life.get("load_error"):
            text += f": {str(life['load_error']).strip()}"
        if len(text) > _PROBE_ERROR_WIDTH:
            text = text[:_PROBE_ERROR_WIDTH - 1] + "…"
        return Text(text, style=_STATE_STYLES.get(state, "yellow"))
    if m.get("degraded"):
        text = f"degraded → {m.get('fallback') or MISSING}"
        if m.get("degraded_reason"):
            text += f" ({m['degraded_reason']})"
        return Text(text, style="bold yellow")
    healthy = m.get("healthy")
    if healthy is True:
        return Text("ok", style="green")
    if healthy is False:
        lines = str(m.get("probe_error") or "").strip().splitlines()
        error = lines[0] if lines else "unhealthy"
        if len(error) > _PROBE_ERROR_WIDTH:
            error = error[:_PROBE_ERROR_WIDTH - 1] + "…"
        return Text(error, style="bold red")
    return Text(MISSING)


def _routes(routes: list[dict[str, Any]]) -> RenderableType:
    """One line per route: name, kind, and each target's share ("a 90% · b 10%")."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(no_wrap=True, overflow="ellipsis")
    for r in routes:
        shares = r.get("shares") if isinstance(r.get("shares"), dict) else {}
        split = " · ".join(f"{model} {fmt_share(share)}" for model, share in shares.items()) or MISSING
        grid.add_row(Text.assemble(("route ", "dim"), (str(r.get("name", MISSING)), "bold")),
                     str(r.get("kind") or MISSING), split)
    return grid


def requests(s: dict[str, Any], max_requests: int | None) -> RenderableType:
    """Running first, then the oldest: the ones to look at when something is stuck."""
    listed = s.get("requests")
    if not isinstance(listed, list):
        return Panel(Text(MISSING), title="requests", title_align="left", box=box.ROUNDED)
    order = {"running": 0, "swapped": 1, "waiting": 2}
    rows = sorted(dicts(listed), key=lambda r: (order.get(str(r.get("state")), 3), -num(r.get("age_seconds"))))
    shown = rows if max_requests is None else rows[:max(0, max_requests)]
    t = table()
    t.add_column("id", justify="right")
    widest = max((len(str(r.get("class", MISSING))) for r in shown), default=1)
    t.add_column("class", no_wrap=True, min_width=widest)
    t.add_column("state")
    for name in ("age", "tokens in/out", "TTFT"):
        t.add_column(name, justify="right")
    for r in shown:
        state = str(r.get("state", MISSING))
        t.add_row(
            fmt_int(r.get("id")), str(r.get("class", MISSING)), Text(state, style=_REQUEST_STYLES.get(state, "")),
            fmt_dur(r.get("age_seconds")), f"{fmt_int(r.get('prompt_tokens'))} / {fmt_int(r.get('output_tokens'))}",
            fmt_dur(r.get("ttft_seconds")),
        )
    title = f"requests ({len(rows)})"
    if len(shown) < len(rows):
        title += f", {len(rows) - len(shown)} not shown"
    return Panel(t, title=title, title_align="left", box=box.ROUNDED)


def counters(s: dict[str, Any]) -> RenderableType:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    misses: dict[str, int] = {}
    for c in dicts(s.get("classes")):
        deadline_misses = c.get("deadline_misses")
        for kind, n in (deadline_misses.items() if isinstance(deadline_misses, dict) else ()):
            misses[kind] = misses.get(kind, 0) + int(num(n))
    shed = s.get("shed_level")
    shed_text = Text(fmt_int(shed), style="bold red" if is_num(shed) and shed > 0 else "")
    if isinstance(s.get("shed_actions"), dict) and s["shed_actions"]:
        shed_text.append(f" ({fmt_counts(s['shed_actions'])})", style="dim")
    grid.add_row("preemptions", fmt_counts(s.get("preemptions")))
    grid.add_row("timeouts", fmt_counts(s.get("timeouts")))
    grid.add_row("rejections", fmt_counts(s.get("rejections")))
    grid.add_row("deadline misses", fmt_counts(misses) if dicts(s.get("classes")) else MISSING)
    grid.add_row("shed level", shed_text)
    lag = s.get("event_loop_lag_seconds")
    if is_num(lag) and lag >= LOOP_LAG_SHOWN:  # (only when it matters: every stream waits as long)
        grid.add_row("event loop lag", Text(f"{lag * 1000:.0f} ms", style="bold red" if lag >= 0.25 else "yellow"))
    return Panel(grid, title="counters", title_align="left", box=box.ROUNDED)


def drift(s: dict[str, Any]) -> RenderableType | None:
    """The traffic's drift from its baseline (two lines); None (no region) without [request_log]."""
    d = s.get("drift")
    if not isinstance(d, dict):
        return None
    psi = d.get("psi") if isinstance(d.get("psi"), dict) else {}
    line1 = Text("PSI ", style="dim")
    for feature, value in psi.items():
        style = "bold red" if is_num(value) and value > 0.2 else "yellow" if is_num(value) and value > 0.1 else ""
        line1.append(f"{_FEATURE_NAMES.get(feature, feature)} ")
        line1.append(f"{value:.2f}" if is_num(value) else MISSING, style=style)
        line1.append("  ")
    if not psi:
        line1.append("- (the baseline or the window is still empty)")
    refusals = d.get("refusal_rate")
    line2 = Text.assemble(
        ("window ", "dim"), fmt_int(d.get("window_requests")), " req  ",
        ("prompt ", "dim"), fmt_int(d.get("mean_prompt_tokens")), " tok  ",
        ("output ", "dim"), fmt_int(d.get("mean_completion_tokens")), " tok  ",
        ("refusals ", "dim"), f"{refusals:.1%}" if is_num(refusals) else MISSING, "  ",
        ("baseline ", "dim"), fmt_int(d.get("baseline_requests")), " req",
        ("" if d.get("baseline_complete") else " (filling)", "yellow"),
    )
    return Panel(Group(line1, line2), title="drift", title_align="left", box=box.ROUNDED)


def table() -> Table:
    # NOTE: one space of padding, one of separator: twelve columns fit an 80-column pane's
    # worth of data in 120 columns without truncating class names
    return Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))


# ------------------------------------------------------------------------------ formatting


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def num(v: Any) -> float:
    return float(v) if is_num(v) else 0.0


def fmt_int(v: Any) -> str:
    return str(int(v)) if is_num(v) else MISSING


def fmt_count(v: Any) -> str:
    """A count that grows without bound, in at most 6 characters: 9999, 12.3k, 4.5M, 1.2G."""
    if not is_num(v):
        return MISSING
    if abs(v) < 10_000:
        return str(round(v))
    v /= 1000
    for unit in ("k", "M"):
        if abs(v) < 999.95:  # what would round to 1000.0 moves up a unit
            return f"{v:.1f}{unit}"
        v /= 1000
    return f"{v:.1f}G"


def fmt_share(v: Any) -> str:
    """A fraction as a percentage, to three digits: 0.9 -> 90%, 1/3 -> 33.3%, 0.005 -> 0.5%."""
    return f"{v * 100:.3g}%" if is_num(v) else MISSING


def fmt_dur(v: Any) -> str:
    """Seconds, human-sized: 110ms, 1.2s, 3m05s, 2h07m."""
    if not is_num(v):
        return MISSING
    if v < 1:
        return f"{v * 1000:.0f}ms"
    if v < 60:
        return f"{v:.1f}s"
    if v < 3600:
        return f"{int(v // 60)}m{int(v % 60):02d}s"
    return f"{int(v // 3600)}h{int(v % 3600 // 60):02d}m"


def dicts(v: Any) -> list[dict[str, Any]]:
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def fmt_counts(d: Any) -> str:
    """{"recompute": 3, "swap": 1} -> "recompute 3, swap 1"; {} -> "0"; absent -> "-"."""
    if not isinstance(d, dict):
        return MISSING
    items = [f"{k} {int(n)}" for k, n in sorted(d.items()) if is_num(n) and n]
    return ", ".join(items) or "0"


def fmt_total(d: Any) -> str:
    if not isinstance(d, dict):
        return MISSING
    return str(sum(int(n) for n in d.values() if is_num(n)))
