"""Where speculation stops paying on this CPU: the engine alone (no HTTP), the default model,
`--speculative auto` (or `--method suffix`, `ngram`) against `off` at batch sizes 1-32, on copying prompts (a passage given
twice, asked for again: most drafts accepted) and on plain ones (questions: few drafts, most
rejected). `[speculative] max_batch` (auto's limit) is the largest batch where suffix is not
slower on either kind.

    .venv/bin/python bench/speculation/crossover.py [--method auto] [--batches 1,2,4,8,16,32] [--tokens 96]

Prints, per kind and batch size, output tok/s off and on, their ratio, and the share of drafts
accepted. Each figure is the best of --repeats runs, the two methods alternating.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inferd.engine.builder import load_model  # noqa: E402
from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.settings.policy import SchedulingPolicy, ShedConfig  # noqa: E402
from inferd.text.sampling_params import SamplingParams  # noqa: E402

PASSAGES = [
    "The old harbour town woke slowly under a pale winter sky. Fishermen dragged their nets across the wet "
    "stones, gulls circled above the market stalls, and the baker on the corner opened his shutters.",
    "In the mountains the snow came early that year. The shepherds brought their flocks down the valley, "
    "the river froze at its edges, and the village lit its lamps an hour before supper.",
    "The library kept its rarest books in a locked room at the top of the tower, where the clock ticked "
    "louder than anyone dared to speak and the dust danced in the afternoon light.",
]
QUESTIONS = ["Name three rivers in Europe and say which is longest.", "What makes a good cup of tea?",
             "Describe a walk in a forest in autumn.", "Why do cats purr? Give two reasons."]


def copying(i: int) -> str:
    p = PASSAGES[i % len(PASSAGES)]
    return f"Passage {i}: {p}\nThe same passage again: {p}\nAnd once more, word for word:"


def plain(i: int) -> str:
    return f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"


def run(engine: LLMEngine, prompts: list[str], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-draft-tokens", type=int, default=8)
    parser.add_argument("--method", default="auto", help="the speculating side: auto, suffix or ngram")
    args = parser.parse_args()
    model, tokenizer = load_model(EngineConfig())
    # (shedding off: a batch's TTFT in a slow offline run would shed it down to a few sequences)
    policy = SchedulingPolicy(shedding=ShedConfig(enabled=False))
    engines = {m: LLMEngine(model, tokenizer, EngineConfig.of(speculative=m, max_draft_tokens=args.max_draft_tokens,
                                                              max_num_seqs=64, max_num_batched_tokens=2048, policy=policy))
               for m in ("off", args.method)}
    for engine in engines.values():
        run(engine, [copying(0)], 8)  # warm-up
    print(f"{'kind':8s} {'batch':>5s} {'off tok/s':>10s} {args.method + ' tok/s':>13s} {'ratio':>6s} {'accepted':>9s}")
    for kind, make in (("copy", copying), ("plain", plain)):
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [make(i) for i in range(batch)]
            best = {m: 0.0 for m in engines}
            spec = engines[args.method].speculator
            drafted0, accepted0 = spec.drafted_tokens, spec.accepted_tokens
            for _ in range(args.repeats):
                for method, engine in engines.items():
                    best[method] = max(best[method], run(engine, prompts, args.tokens))
            drafted, accepted = spec.drafted_tokens - drafted0, spec.accepted_tokens - accepted0
            share = f"{accepted / drafted:.0%}" if drafted else "-"
            on = best[args.method]
            print(f"{kind:8s} {batch:5d} {best['off']:10.1f} {on:13.1f} {on / best['off']:6.2f} {share:>9s}", flush=True)


if __name__ == "__main__":
    main()
