"""Start-up time: from a fresh process to a model ready to generate, inferd against peers.

Each measurement runs in a new Python process (imports included, as an operator sees it) and
is the median of --repeats runs:
  inferd        LLMEngine.from_config: header, dequantization, tokenizer, KV cache (bfloat16)
  GGUFReader    gguf.GGUFReader(path) alone, the metadata reader inferd replaces
  transformers  AutoModelForCausalLM.from_pretrained(gguf_file=...) plus AutoTokenizer

    python bench/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

SNIPPETS = {
    "inferd": (
        "from inferd.engine.config import EngineConfig; from inferd.engine.llm_engine import LLMEngine\n"
        "LLMEngine.from_config(EngineConfig.of(dtype='bfloat16'))\n"
    ),
    "GGUFReader (metadata only)": (
        "import gguf\nfrom inferd.model.loading.loader import default_model_path\n"
        "gguf.GGUFReader(default_model_path())\n"
    ),
    "transformers": (
        "import torch, transformers\nfrom inferd.model.loading.loader import default_model_path\n"
        "p = default_model_path()\n"
        "transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.bfloat16)\n"
        "transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)\n"
    ),
}
TIMED = "import time\n_t = time.perf_counter()\n{body}print(time.perf_counter() - _t)\n"


def measure(body: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", TIMED.format(body=body)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = {name: statistics.median(measure(body) for _ in range(args.repeats)) for name, body in SNIPPETS.items()}
    ours = results["inferd"]
    print(f"median of {args.repeats} fresh processes, imports included\n")
    print("| what | seconds | vs inferd |")
    print("|---|---:|---:|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds:.2f} | {seconds / ours:.2f}x |")


if __name__ == "__main__":
    main()
