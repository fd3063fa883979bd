"""compare.py's workload and goals: the same driver flags on every side, the paths it uses, and issue
30's targets against each peer."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path




REPO = Path(__file__).resolve().parents[2]  # (bench/peers/workload.py: the repository root)
DEFAULT_PEER_BIN = Path(os.environ.get("INFERD_PEER_DIR", Path.home() / ".cache/inferd/llama-server")) / "bin/llama-server"
PREPARE_VLLM = REPO / "bench" / "prepare_vllm_cpu.sh"
DEFAULT_RESULTS = REPO / "bench" / "RESULTS.md"
CONCURRENCIES = {"requests": (1, 4, 16, 32), "conversation": (1, 8), "agent": (1, 8),  # conversation, agent: sessions
                 "prefill": (1,)}  # one request at a time
OUTPUT_LEN = 128
WARMUP = 2
MAX_OTHER_CORES = 0.2  # other processes' CPU above this: the run is repeated once
LLAMA_CONTEXT_PER_SESSION = 8192  # llama-server on conversations: the default model's whole context per slot
PREFILL_CONTEXT = 8192  # prefill: llama-server's one slot and vLLM's --max-model-len (the default model's limit)
VLLM_MIN_SEQS = 32  # vLLM's --max-num-seqs: at least this, more when a concurrency asks for more
VLLM_KVCACHE_GIB = 4

# The workload, identical on every side: `inferd bench URL` + these + the per-point flags
# (--concurrency, --num-requests, --json, --model). Streaming /v1/completions; prompts of
# 30-60 tokens of prose (uniform over [45(1 - s), 45(1 + s)] = [30, 60] with s = 0.3333),
# exactly OUTPUT_LEN output tokens (EOS ignored), a fixed seed: the same prompts on every side.
REQUESTS_ARGS = (
    "--endpoint", "completions", "--input-len", "45", "--input-dist", "uniform", "--spread", "0.3333",
    "--output-len", str(OUTPUT_LEN), "--output-dist", "fixed", "--ignore-eos", "--warmup", str(WARMUP), "--seed", "0",
)
# Multi-turn sessions (the driver's own shapes: shared system prompt, tool results, answers),
# streamed chat completions, answers of the length asked (EOS ignored), a fixed seed.
CONVERSATION_ARGS = ("--workload", "conversation", "--endpoint", "chat", "--ignore-eos", "--seed", "0")
# Coding-agent sessions (the driver's agent workload: tool schemas, files read, command output, two
# turns a session that copy a file back), the same way, after one warm-up first turn (the shared
# system prompt cached, as an agent server's steady state has it).
AGENT_ARGS = ("--workload", "agent", "--endpoint", "chat", "--ignore-eos", "--seed", "0", "--warmup", "1")

# where each compared metric is in a run's `summary` of the driver's JSON ({"runs": [{"summary":
# ...}]}), and the factor that makes it tokens/s or seconds
SUMMARY_KEYS: dict[str, tuple[tuple[str, ...], float]] = {
    "output_tok_s": (("output_throughput",), 1.0),
    "ttft_p50": (("ttft", "p50"), 1.0),
    "ttft_p99": (("ttft", "p99"), 1.0),
    "tpot_p50": (("tpot", "p50"), 1.0),
    "tpot_p99": (("tpot", "p99"), 1.0),
}
# the same, where the driver may or may not report them (the conversation workload's split of TTFT)
OPTIONAL_KEYS: dict[str, tuple[tuple[str, ...], float]] = {
    "ttft_first_p99": (("ttft_first_turn", "p99"), 1.0),
    "ttft_later_p99": (("ttft_later_turns", "p99"), 1.0),
}


@dataclass(frozen=True)
class Targets:
    """Issue 30's acceptance against one peer on one workload."""

    throughput: dict[int, float]  # concurrency -> least inferd / peer output tok/s
    ttft_key: str  # the TTFT metric inferd must have at or below the peer's ...
    ttft_from: int  # ... at every concurrency from this one up


TARGETS: dict[tuple[str, str], Targets] = {  # (peer, workload)
    ("llama", "requests"): Targets({1: 1.0, 16: 2.0, 32: 2.0}, "ttft_p99", 4),
    ("vllm", "requests"): Targets({1: 1.0, 4: 1.0, 16: 1.5, 32: 1.5}, "ttft_p99", 4),
    ("llama", "conversation"): Targets({1: 1.0, 8: 1.0}, "ttft_later_p99", 1),
}
PEERS = {"llama": "llama-server", "vllm": "vllm"}  # --peer value -> the side's name in tables and files


def bench_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The driver's workload flags, the same for every side."""
    if args.workload == "requests":
        return REQUESTS_ARGS
    if args.workload == "agent":
        return AGENT_ARGS
    return CONVERSATION_ARGS + (("--turns", str(args.turns)) if args.turns else ())
