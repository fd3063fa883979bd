"""A/B: one benchmark script, run on another commit and on this tree, interleaved in one session.

A speed claim here is a ratio against a peer measured together on the same 2-core machine, so
this runs `python BENCH_SCRIPT ARGS` N times for each side, alternating, and prints the ratio
head/base of the medians as a markdown section ready for bench/RESULTS.md.

    python bench/ab.py --base REF [--head REF] [--runs N] [--metric REGEX] [--lower-is-better] -- BENCH_SCRIPT [ARGS...]
    python bench/ab.py --base HEAD -- bench/scheduler_step.py        # your edits against HEAD
    python bench/ab.py --base HEAD~3 --head HEAD -- bench/serve_overhead.py --concurrency 128
    python bench/ab.py --base HEAD --head HEAD -- bench/scheduler_step.py   # A/A: the noise floor

    base:   a detached `git worktree` of REF at /tmp/inferd-ab-<sha10>, made once and reused
    head:   this working tree, uncommitted edits included (--head REF: a worktree of REF too)
    a run:  cd TREE && PYTHONPATH=TREE <this repo's .venv/bin/python> BENCH_SCRIPT ARGS
    order:  base head | head base | base head | ...  (each pair swaps, so a linear drift or a
            first-run effect lands on both sides alike)

Each side imports its own `inferd` (PYTHONPATH comes before the editable install's finder; a
subprocess checks `inferd.__file__` before any run) and runs its own copy of BENCH_SCRIPT. The
worktrees live outside the repository and never move this checkout; remove one with
`git worktree remove /tmp/inferd-ab-<sha10>`. The working tree may be edited while this runs:
its code (HEAD + diff + untracked files) is hashed before each head run, and a change is marked.

Numbers come from each run's output (stdout and stderr together): `--metric REGEX` (repeatable),
one group capturing a number (thousands separators allowed); several matches in one run give
their median; a group named `key` makes one metric per key (the number is then group `value`).
Higher is better unless --lower-is-better (for a script below, its built-in direction). Built
in, used when no --metric is given:

    bench/serve_overhead.py   "served: median N streamed tokens/s" (or --engine-only's "engine
                              only: median N tokens/s"), higher is better; and the server's
                              "LLMEngine.step N ms" per full step, lower is better.
                              Default ARGS `--runs 3`: the script's own workload, as in
                              RESULTS.md (256 streams x 200 tokens, median of 3 runs in one
                              process); ~12 s a run, so --runs 5 here (the default) takes ~2 min.
    bench/scheduler_step.py   each table row's "median ms/step", one metric per running count,
                              lower is better. Default ARGS `--running 64,256,1024 --steps 500`:
                              ~2.3 s a run, --runs 5 ~25 s (plus the waits for a quiet machine).

Default ARGS are used only when no ARGS follow BENCH_SCRIPT. Spread seen in A/A runs (one
commit on both sides, 5 runs a side) on the 2-core machine, 2026-11-30:
    scheduler_step, 256 running: 1-9% per side (max - min over median); pair ratios 0.97-1.07;
        head/base of the medians 1.000 and 1.027. 1024 running: up to 30% (a slow run in five).
    serve_overhead: 20-23% per side even on an idle machine (17k to 21k tokens/s, drifting over
        minutes; the interleaving cancels the drift); pair ratios 0.93-1.14 (0.86-1.14 with
        --runs 1); head/base of the medians 0.977, 1.032, 1.072. With another process on one
        of the two cores it reads ~14k.
So trust a serve_overhead ratio only beyond ~±8%, a scheduler_step one beyond ~±3%; run an A/A
(--base REF --head REF) when in doubt.
Other processes' CPU during each run is measured (/proc/stat busy time less the run's own CPU):
runs where it exceeded 0.2 cores are starred, and each run first waits up to --idle-wait seconds
for a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from peers.cpu import machine_busy_seconds, reaped_children_seconds  # (bench/ is this script's folder)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PYTHON = REPO / ".venv" / "bin" / "python"
WORKTREE_PREFIX = "/tmp/inferd-ab-"
MAX_OTHER_CORES = 0.2  # other processes' CPU above this during a run: the run is starred
NUMBER = r"[0-9][0-9,_]*(?:\.[0-9]+)?"


# ------------------------------------------------------------------------------ metrics

@dataclass(frozen=True)
class Metric:
    label: str  # "{key}" in it is replaced by the `key` group
    pattern: re.Pattern[str]  # group `value` (else group 1) is the number; group `key`: one metric per key
    lower_is_better: bool

    def extract(self, output: str) -> dict[str, float]:
        """label -> value found in one run's output (the median when it matches several times)."""
        found: dict[str, list[float]] = {}
        for m in self.pattern.finditer(output):
            groups = m.groupdict()
            label = self.label
            if "key" in groups:  # NOTE: replace, not format: a label may be a regex with braces
                label = label.replace("{key}", groups["key"]) if "{key}" in label else f"{label} [{groups['key']}]"
            found.setdefault(label, []).append(parse_number(groups.get("value") or m.group(1)))
        return {label: statistics.median(values) for label, values in found.items()}


def parse_number(text: str) -> float:
    return float(re.sub(r"[,_\s\u2009\u202f]", "", text))


def metric(label: str, regex: str, lower_is_better: bool) -> Metric:
    return Metric(label, re.compile(regex, re.MULTILINE), lower_is_better)


@dataclass(frozen=True)
class Preset:
    """What this runner knows about one benchmark script: default ARGS and headline numbers."""
    args: tuple[str, ...]
    metrics: tuple[Metric, ...]


PRESETS: dict[str, Preset] = {
    # NOTE: --runs 3 is the script's default, written out so the results name it: a median of 3
    # in each process halved the A/A pair-ratio range of --runs 1 (single runs vary by ±10%).
    "bench/serve_overhead.py": Preset(("--runs", "3"), (
        metric("streamed tokens/s", rf"^(?:served|engine only): median ({NUMBER}) (?:streamed )?tokens/s", False),
        metric("LLMEngine.step ms (full steps)", rf"LLMEngine\.step ({NUMBER}) ms", True),
    )),
    "bench/scheduler_step.py": Preset(("--running", "64,256,1024", "--steps", "500"), (
        metric("running {key}: median ms/step", rf"^\| (?P<key>\d+) \| (?P<value>{NUMBER}) \|", True),
    )),
}


# ------------------------------------------------------------------------------ git trees

@dataclass(frozen=True)
class Side:
    name: str  # "base" or "head"
    tree: Path
    sha: str
    description: str  # how the results section names it

    @property
    def live(self) -> bool:
        """The working tree itself, which others may be editing."""
        return self.tree == REPO


def git(*args: str, cwd: Path = REPO) -> str:
    # NOTE: --no-optional-locks: `status` here must not take index.lock from someone's commit
    out = subprocess.run(["git", "--no-optional-locks", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.rstrip("\n")  # NOTE: not strip(): `status --porcelain` lines start with a space


def worktree(name: str, ref: str) -> Side:
    """A detached worktree of `ref` under /tmp, made now or reused."""
    out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"--{name}: {ref!r} is not a commit here")
    sha = out.stdout.strip()
    path = Path(f"{WORKTREE_PREFIX}{sha[:10]}")
    if not path.exists():
        # `worktree add` writes only .git/worktrees/ and the new folder: this checkout is untouched
        git("worktree", "add", "--detach", "--quiet", str(path), sha)
    elif git("rev-parse", "HEAD", cwd=path) != sha:
        sys.exit(f"{path} is not at {sha}: remove it (git worktree remove --force {path})")
    if dirty := git("status", "--porcelain", "--untracked-files=no", cwd=path):
        sys.exit(f"{path} has local edits, so it is not {sha[:10]}:\n{dirty}\n"
                 f"remove it (git worktree remove --force {path}) and run again")
    return Side(name, path, sha, f"`{ref}` = `{sha}` (worktree `{path}`)")


def working_tree() -> Side:
    sha = git("rev-parse", "HEAD")
    changed = [line[3:] for line in git("status", "--porcelain").splitlines()]
    if not changed:
        return Side("head", REPO, sha, f"the working tree at `{sha}` (clean)")
    shown = ", ".join(f"`{p}`" for p in changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return Side("head", REPO, sha, f"the working tree at `{sha}` + uncommitted changes to {shown}")


def code_fingerprint(tree: Path) -> str:
    """A hash of the code a run there would see: HEAD, the uncommitted diff, untracked files."""
    h = hashlib.sha1(git("rev-parse", "HEAD", cwd=tree).encode())
    h.update(git("diff", "HEAD", "--binary", cwd=tree).encode())
    for rel in git("ls-files", "--others", "--exclude-standard", cwd=tree).splitlines():
        try:
            h.update(rel.encode() + (tree / rel).read_bytes())
        except OSError:  # deleted since the listing: part of the change anyway
            h.update(rel.encode())
    return h.hexdigest()[:12]


def side_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def check_imports(side: Side, python: Path) -> None:
    """Each side must import its own `inferd`, not the editable install's one in this checkout."""
    out = subprocess.run([str(python), "-c", "import inferd; print(inferd.__file__)"], cwd=side.tree,
                         env=side_env(side.tree), capture_output=True, text=True)
    where = out.stdout.strip()
    if out.returncode != 0 or Path(where).resolve() != (side.tree / "inferd" / "__init__.py").resolve():
        sys.exit(f"{side.name}: `import inferd` in {side.tree} gave {where or out.stderr.strip()!r}, "
                 f"not {side.tree}/inferd/__init__.py")
    print(f"{side.name}: {side.tree} at {side.sha[:10]} imports {where}", file=sys.stderr)


# ------------------------------------------------------------------------------ CPU accounting

def wait_idle(limit_s: float) -> None:
    """Wait, up to limit_s, for half a second in which other processes use under MAX_OTHER_CORES."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy, t = machine_busy_seconds(), time.monotonic()
        time.sleep(0.5)
        if (machine_busy_seconds() - busy) / (time.monotonic() - t) < MAX_OTHER_CORES:
            return


# ------------------------------------------------------------------------------ runs

@dataclass
class Run:
    side: str
    index: int  # the pair it belongs to
    wall_s: float
    other_cores: float  # other processes' CPU during the run, in cores
    values: dict[str, float] = field(default_factory=dict)
    lower_is_better: dict[str, bool] = field(default_factory=dict)  # per label in values
    code: str = ""  # the live tree's code fingerprint when it started ("" for a worktree)

    @property
    def disturbed(self) -> bool:
        return self.other_cores > MAX_OTHER_CORES


@dataclass(frozen=True)
class Job:
    python: Path
    script: str  # relative to each tree
    args: tuple[str, ...]
    metrics: tuple[Metric, ...]
    timeout_s: float

    def command(self) -> list[str]:
        return [str(self.python), self.script, *self.args]


def run_once(job: Job, side: Side, index: int) -> Run:
    """One run of the script on one side, in its own process group (its children die with it)."""
    code = code_fingerprint(side.tree) if side.live else ""
    busy, child, start = machine_busy_seconds(), reaped_children_seconds(), time.perf_counter()
    proc = subprocess.Popen(job.command(), cwd=side.tree, env=side_env(side.tree), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=job.timeout_s)
    except BaseException as e:  # a timeout or ^C: serve_overhead's server must not outlive it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            sys.exit(f"{side.name} run {index + 1} took over {job.timeout_s:.0f} s (--timeout): "
                     f"cd {side.tree} && {shlex.join(job.command())}")
        raise
    wall = time.perf_counter() - start
    other = max(0.0, (machine_busy_seconds() - busy) - (reaped_children_seconds() - child)) / wall
    values: dict[str, float] = {}
    lower: dict[str, bool] = {}
    for m in job.metrics:
        found = m.extract(output)
        values.update(found)
        lower.update(dict.fromkeys(found, m.lower_is_better))
    if proc.returncode != 0 or not values:
        tail = "\n".join(output.splitlines()[-40:])
        hint = "\n(the working tree may be mid-edit: --head HEAD measures committed code)" if side.live else ""
        why = f"exit code {proc.returncode}" if proc.returncode != 0 else "no metric matched"
        sys.exit(f"{side.name} run {index + 1} failed ({why}): cd {side.tree} && {shlex.join(job.command())}\n"
                 f"{tail}{hint}")
    return Run(side.name, index, wall, other, values, lower, code)


def run_all(job: Job, base: Side, head: Side, runs: int, idle_wait_s: float) -> list[Run]:
    done: list[Run] = []
    for i in range(runs):
        for side in (base, head) if i % 2 == 0 else (head, base):
            wait_idle(idle_wait_s)
            run = run_once(job, side, i)
            done.append(run)
            shown = ", ".join(f"{k} {fmt(v)}" for k, v in run.values.items())
            print(f"[{len(done)}/{2 * runs}] {side.name}: {shown} ({run.wall_s:.1f} s, other processes "
                  f"{run.other_cores:.2f} cores{', DISTURBED' if run.disturbed else ''})", file=sys.stderr, flush=True)
    return done


# ------------------------------------------------------------------------------ report

def fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 100 else f"{x:.4g}"


def verdict(ratio: float, pair_ratios: list[float], lower_is_better: bool) -> str:
    """'head better/worse by x%', with how many pairs agree and a two-sided sign test on them."""
    if abs(ratio - 1) < 0.0005:
        return "no change"
    better = ratio < 1 if lower_is_better else ratio > 1
    signs = [r > 1 for r in pair_ratios if r != 1]
    agree = sum(s == (ratio > 1) for s in signs)
    # NOTE: with no real change each pair's sign is a coin toss: 5 of 5 pairs agreeing is p = 0.06
    p = min(1.0, 2 * sum(math.comb(len(signs), k) for k in range(agree, len(signs) + 1)) / 2 ** len(signs))
    return (f"head {'better' if better else 'worse'} by {abs(ratio - 1) * 100:.1f}% "
            f"({agree} of {len(pair_ratios)} pairs agree, sign test p = {p:.2g})")


def metric_rows(label: str, lower: bool, runs: list[Run], codes: dict[str, int]) -> tuple[list[str], str]:
    """The table rows of one metric (base, head, head/base) and its one-line summary."""
    rows, per_side = [], {}
    for side in ("base", "head"):
        side_runs = sorted((r for r in runs if r.side == side), key=lambda r: r.index)
        values = [r.values[label] for r in side_runs]
        cells = [fmt(v) + ("\\*" if r.disturbed else "") + (f" (c{codes[r.code]})" if len(codes) > 1 and r.code else "")
                 for v, r in zip(values, side_runs)]
        med = statistics.median(values)
        spread = (max(values) - min(values)) / med * 100 if med else math.nan
        per_side[side] = (values, med)
        cell = label.replace("|", "\\|")  # NOTE: a `|` in a label (a --metric regex) would end the cell
        name = f"{cell} ({'lower' if lower else 'higher'} is better)" if side == "base" else ""
        rows.append(f"| {name} | {side} | " + " | ".join(cells) + f" | {fmt(med)} | {spread:.1f}% |")
    (base_values, base_median), (head_values, head_median) = per_side["base"], per_side["head"]
    pairs = [h / b for b, h in zip(base_values, head_values)]
    ratio = head_median / base_median
    rows.append("| | head/base | " + " | ".join(f"{r:.3f}" for r in pairs)
                + f" | **{ratio:.3f}** | {min(pairs):.3f}–{max(pairs):.3f} |")
    return rows, f"- {label}: head/base **{ratio:.3f}**, {verdict(ratio, pairs, lower)}"


def report(job: Job, base: Side, head: Side, runs: list[Run], elapsed_s: float) -> str:
    n = max(r.index for r in runs) + 1
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "unknown CPU"
    each_run = f"PYTHONPATH=TREE {os.path.relpath(job.python, REPO)} {shlex.join([job.script, *job.args])}"
    lines = [
        f"### A/B: `{job.script}`, head vs `{base.sha[:10]}` ({dt.date.today().isoformat()})",
        "",
        f"`{shlex.join([os.path.relpath(job.python, REPO), 'bench/ab.py', *sys.argv[1:]])}`",
        "",
        f"- base: {base.description}",
        f"- head: {head.description}",
        f"- each run, in each TREE: `{each_run}`",
        f"- {n} run{'s' if n > 1 else ''} a side, interleaved (base head, head base, ...), {elapsed_s:.0f} s in all; "
        f"{os.cpu_count()} cores, {cpu}",
        "",
        "| metric | side | " + " | ".join(f"run {i + 1}" for i in range(n)) + " | median | spread |",
        "|---|---|" + "---:|" * (n + 2),
    ]
    codes = {c: i + 1 for i, c in enumerate(dict.fromkeys(r.code for r in runs if r.code))}
    summaries = []
    lower_is_better = {label: lower for run in runs for label, lower in run.lower_is_better.items()}
    partial = [label for label in lower_is_better if any(label not in r.values for r in runs)]
    for label, lower in lower_is_better.items():
        if label not in partial:
            rows, summary = metric_rows(label, lower, runs, codes)
            lines += rows
            summaries.append(summary)
    if partial:
        summaries.append(f"- not in every run's output, so not compared: {', '.join(partial)}")
    disturbed = sum(r.disturbed for r in runs)
    lines += ["", *summaries, "",
              f"Median: of the {n} runs; spread: (max - min) / median; head/base: each pair's ratio, then the "
              f"ratio of the medians (bold) and the range of the pairs'. Other processes' CPU during a run: "
              f"at most {max(r.other_cores for r in runs):.2f} cores"
              + (f"; \\* marks the {disturbed} run(s) above {MAX_OTHER_CORES}." if disturbed else ".")]
    if len(codes) > 1:
        lines.append(f"WARNING: the working tree's code changed during the A/B: head runs marked c1..c{len(codes)} "
                     f"ran different code (use --head REF for a fixed head).")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main

def parse_args() -> tuple[argparse.Namespace, str, list[str], tuple[Metric, ...]]:
    """The options, the script (relative to the repo), its ARGS and the metrics to read."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against (a detached worktree of it)")
    parser.add_argument("--head", default=None, help="a commit for the head side; default: this working tree")
    parser.add_argument("--runs", type=int, default=5, help="runs of the script on each side (default 5)")
    parser.add_argument("--metric", action="append", default=[], metavar="REGEX",
                        help="a number in the output: one group (or `value`, and `key` for one metric per key)")
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument("--lower-is-better", dest="lower", action="store_const", const=True, default=None,
                           help="for --metric (default: the script's built-in direction, else higher is better)")
    direction.add_argument("--higher-is-better", dest="lower", action="store_const", const=False)
    parser.add_argument("--python", type=Path, default=DEFAULT_PYTHON if DEFAULT_PYTHON.exists() else Path(sys.executable),
                        help="the interpreter for both sides (default: this repo's .venv)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one run (default 600)")
    parser.add_argument("--idle-wait", type=float, default=5.0, help="seconds to wait before each run for "
                        f"other processes to use under {MAX_OTHER_CORES} cores (default 5)")
    parser.add_argument("--out", type=Path, help="also write the markdown section to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- BENCH_SCRIPT [ARGS...]")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark after --: -- bench/serve_overhead.py [ARGS...]")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    script = Path(command[0])
    script_rel = os.path.relpath(script.resolve() if script.is_absolute() else REPO / script, REPO)
    if script_rel.startswith(".."):
        parser.error(f"{script} is not inside {REPO}")
    preset = PRESETS.get(script_rel)
    bench_args = command[1:] or list(preset.args if preset else ())
    if args.metric:
        lower = args.lower if args.lower is not None else bool(preset and preset.metrics[0].lower_is_better)
        try:
            metrics = tuple(metric(f"`{regex}`", regex, lower) for regex in args.metric)
        except re.error as e:
            parser.error(f"--metric: {e}")
        if any(m.pattern.groups < 1 for m in metrics):
            parser.error("--metric: the regex needs a group around the number")
    elif args.lower is not None:
        parser.error("--lower-is-better / --higher-is-better go with --metric (built-in metrics know theirs)")
    elif preset:
        metrics = preset.metrics
    else:
        parser.error(f"no built-in metric for {script_rel} (known: {', '.join(PRESETS)}): give --metric REGEX")
    return args, script_rel, bench_args, metrics


def main() -> None:
    args, script, bench_args, metrics = parse_args()
    base = worktree("base", args.base)
    head = working_tree() if args.head is None else worktree("head", args.head)
    for side in (base, head):
        if not (side.tree / script).exists():
            sys.exit(f"{side.name}: {script} does not exist at {side.sha[:10]}")
        check_imports(side, args.python)
    job = Job(args.python, script, tuple(bench_args), metrics, args.timeout)
    start = time.perf_counter()
    runs = run_all(job, base, head, args.runs, args.idle_wait)
    text = report(job, base, head, runs, time.perf_counter() - start)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
