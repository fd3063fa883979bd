"""Every environment variable inferd reads, declared once: its name, what it does, and the one
function that reads it. docs/configuration.md lists them from here (settings/docs.py).

Settings keys themselves may also come from `INFERD_<TABLE>_<KEY>` (config.py's load_settings).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    description: str
    default: str = ""  # what unset means, in words

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        value = (os.environ if environ is None else environ).get(self.name)
        return value or None


API_KEYS = Variable("INFERD_API_KEYS", "API keys `inferd serve` accepts, comma-separated, in the clear "
                    "(beside --api-key and [server] api_keys_file).", "none")
API_KEY = Variable("INFERD_API_KEY", "The key `inferd bench` and `inferd status` send (--api-key wins).", "none")
FAULTS = Variable("INFERD_FAULTS", "Faults armed in the engine for failure tests, as JSON, e.g. "
                  '`{"forward_failures": 2}` (engine/worker/faults.py); never set in production.', "none")
KERNEL_DIR = Variable("INFERD_KERNEL_DIR", "Where the CPU kernels built for this machine are kept.",
                      "~/.cache/inferd/kernels")
CXX = Variable("CXX", "The C++ compiler that builds the CPU kernels.", "g++")
ONEDNN_MAX_CPU_ISA = Variable(
    "ONEDNN_MAX_CPU_ISA", "oneDNN's instruction-set cap, read once at its first product. inferd sets it to "
    "AVX512_CORE_BF16 when unset: on AMX CPUs the tile path's rows differ in the last bits with the batch, "
    "which would break [model] deterministic. An operator's own value wins.", "AVX512_CORE_BF16 (set by inferd)")
AMX = Variable("INFERD_AMX", "`off` masks AMX from inferd's block products (the VNNI kernel runs every row "
               "count, as on a CPU without AMX); where the CPU has it, each layer shape's row count from which the "
               "tile kernel runs is measured at load (the two give the same bits).", "measured at load")
NOTIFY_SOCKET = Variable("NOTIFY_SOCKET", "systemd's notify socket: READY=1, STATUS, STOPPING=1 "
                         "(api/systemd.py reads it, with the two below).", "no notifications")
WATCHDOG_USEC = Variable("WATCHDOG_USEC", "systemd's watchdog period: WATCHDOG=1 every half of it.", "no watchdog")
WATCHDOG_PID = Variable("WATCHDOG_PID", "The process the watchdog period is meant for.", "this process")

TIKTOKEN_ENCODINGS_BASE = Variable(
    "TIKTOKEN_ENCODINGS_BASE", "The folder openai_harmony reads `o200k_base.tiktoken` from (gpt-oss's chat format; "
    "its sha256 is checked). inferd sets it, when unset, to the file `make setup` makes (inferd/text/o200k.py); "
    "nothing is downloaded.", "the venv's share/inferd/tiktoken (set by inferd)")
COLUMNS = Variable("COLUMNS", "The width `inferd status` draws to when its output is not a terminal.", "120")

VARIABLES = (API_KEYS, API_KEY, FAULTS, KERNEL_DIR, CXX, ONEDNN_MAX_CPU_ISA, AMX, NOTIFY_SOCKET, WATCHDOG_USEC,
             WATCHDOG_PID, TIKTOKEN_ENCODINGS_BASE, COLUMNS)

DEFAULT_ONEDNN_ISA = "AVX512_CORE_BF16"


def kernel_dir() -> Path:
    """Where the CPU kernels' libraries are kept."""
    return Path(KERNEL_DIR.get() or Path.home() / ".cache" / "inferd" / "kernels")


def cap_onednn_isa() -> None:
    """Cap oneDNN's ISA before any product unless the operator set it (see ONEDNN_MAX_CPU_ISA)."""
    os.environ.setdefault(ONEDNN_MAX_CPU_ISA.name, DEFAULT_ONEDNN_ISA)
