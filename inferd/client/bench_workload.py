"""`inferd bench`'s workload: what each request asks for, and when open-loop requests arrive.

Synthetic prompts are runs of words from a passage of ordinary English prose, so a server's
tokenizer sees realistic text; a prompt of T tokens gets round(0.75 T) words (English averages
about 0.75 words per BPE token). The client never tokenizes: token counts come from the server.

Every request's spec is a pure function of (seed, request index), so a run is reproducible
whatever order concurrent workers take requests in.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORDS_PER_TOKEN = 0.75
DISTRIBUTIONS = ("fixed", "uniform", "lognormal")

PASSAGE = """\
The town sat where the river bent twice before reaching the sea, and for most of its history
nobody outside the valley had reason to remember its name. Its people fished in the spring,
cut hay in the summer, and spent the long autumn evenings repairing whatever the year had
broken. The bridge was the oldest thing in it. Built of grey stone by workers whose names were
lost long ago, it had outlasted three churches, a mill, and a railway station that closed
before anyone now living was born. Children were told that the bridge would stand as long as
somebody crossed it every day, and so, without ever quite deciding to, everybody did.
In the year the floods came, the water rose faster than the oldest farmers had ever seen. It
covered the lower fields in a single night and climbed the steps of the market hall by noon.
The schoolteacher, a patient woman who kept careful notes about everything, measured the
river each hour with a painted pole and wrote the numbers on the blackboard so that the
children could follow the danger as if it were a lesson in arithmetic. When the level passed
the mark her grandfather had carved into the wall of the bakery, she closed the school and
sent everyone home to help carry furniture upstairs.
What saved the town was not courage, though there was plenty of that, but the habit of
keeping records. For more than a century the clerks at the town hall had written down the
height of every flood, the direction of the wind, and how many days the rain had fallen
before the water turned. A young engineer who had come to inspect the railway bridge found
those ledgers in a cupboard behind the stairs. He sat up through the night comparing the
columns by candlelight, and by morning he could say, with more confidence than he felt, that
the river would crest before sunset and fall quickly after that. He was right within an hour.
Afterwards people argued about what the lesson had been. Some said it proved that the old
ways were best, that a town which remembers its past can face anything. Others said the
opposite: that the ledgers had been useless for a hundred years until someone arrived who
knew how to read them, and that knowledge kept in a cupboard is hardly knowledge at all. The
schoolteacher listened to both sides and then did something practical. She copied the most
important tables into a small book, added a page explaining how to use them, and gave a copy
to every family. The book was not elegant, and a few of the figures turned out to be wrong,
but it was read, which is more than can be said for most careful work.
Years later the engineer returned, older and a little heavier, to design a new embankment.
He found the town changed in small ways. The bakery had become a cafe that sold bread in the
morning and soup at night. The market hall had a new roof and an old clock that still ran
four minutes slow. The bridge was exactly as he remembered it, worn smooth in the middle where
carts and boots and bicycles had passed for generations. On his first evening he walked across
it twice, once to look at the water and once because it seemed impolite not to. He noticed that
the painted pole was still fixed to the wall beside the steps, freshly painted, with a new
line near the top and a date written in a careful hand.
Good planning, he liked to tell his students, is mostly a matter of paying attention to
ordinary things before they become extraordinary. Measure what you can, write it down where
others will find it, and explain what the numbers mean in words a tired person can follow at
two in the morning. The rest is weather, luck, and the patience to wait for the water to fall.
"""
WORDS = PASSAGE.split()


@dataclass(frozen=True)
class RequestSpec:
    """What one request asks for: a prompt (completions) or messages (chat)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    priority: str | None = None


# ---------------------------------------------------------------------------------- prompts


def synthetic_prompt(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of prose: round(0.75 × tokens) words from a random place in the
    passage, wrapping around at its end."""
    n = max(1, round(tokens * WORDS_PER_TOKEN))
    start = rng.randrange(len(WORDS))
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def sample_length(rng: random.Random, mean: int, dist: str, spread: float) -> int:
    """A length ≥ 1 around `mean`: fixed; uniform over [mean(1 − spread), mean(1 + spread)];
    or lognormal with mean `mean` and σ = spread (of the log), capped at 8 × mean."""
    if dist == "fixed":
        return max(1, mean)
    if dist == "uniform":
        lo, hi = max(1, math.floor(mean * (1 - spread))), max(1, math.ceil(mean * (1 + spread)))
        return rng.randint(lo, hi)
    if dist == "lognormal":
        mu = math.log(max(mean, 1)) - spread * spread / 2
        return max(1, min(8 * mean, round(rng.lognormvariate(mu, spread))))
    raise ValueError(f"a length distribution is one of {', '.join(DISTRIBUTIONS)}, got {dist!r}")


def parse_mix(text: str | None) -> dict[str, float]:
    """`interactive=0.2,batch=0.8` → the classes' shares, normalized to sum to 1."""
    mix: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, weight = (s.strip() for s in part.partition("="))
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not sep or not name or not w >= 0:
            raise ValueError(f"--priority-mix takes CLASS=WEIGHT pairs (weights ≥ 0), got {part.strip()!r}")
        mix[name] = w
    total = sum(mix.values())
    if mix and total <= 0:
        raise ValueError("--priority-mix: the weights sum to 0")
    return {name: w / total for name, w in mix.items()}


class Workload:
    """Request i's spec, the same for the same seed: synthetic prompts, or a dataset cycled in
    file order (with lengths and classes from the options where a line gives none)."""

    def __init__(
        self, *, seed: int = 0, chat: bool = False, input_len: int = 32, input_dist: str = "fixed",
        output_len: int = 128, output_dist: str = "fixed", spread: float = 0.5,
        priority_mix: dict[str, float] | None = None, dataset: list[RequestSpec] | None = None,
    ) -> None:
        for dist in (input_dist, output_dist):
            if dist not in DISTRIBUTIONS:
                raise ValueError(f"a length distribution is one of {', '.join(DISTRIBUTIONS)}, got {dist!r}")
        if input_len < 1 or output_len < 1:
            raise ValueError("--input-len and --output-len must be ≥ 1")
        if dataset is not None and not dataset:
            raise ValueError("the dataset has no requests")
        if dataset is not None and not chat:
            for number, item in enumerate(dataset, 1):
                if item.prompt is None:
                    raise ValueError(f"dataset request {number} has `messages` but no `prompt`: use --endpoint chat")
        self.seed, self.chat = seed, chat
        self.input_len, self.input_dist = input_len, input_dist
        self.output_len, self.output_dist = output_len, output_dist
        self.spread = spread
        self.mix = priority_mix or {}
        self.dataset = dataset

    def spec(self, i: int, stream: str = "run") -> RequestSpec:
        """Request i of `stream` ("run", or "warmup": drawn apart so warm-ups change nothing)."""
        rng = random.Random(f"inferd-bench:{self.seed}:{stream}:{i}")
        priority = rng.choices(list(self.mix), weights=list(self.mix.values()))[0] if self.mix else None
        max_tokens = sample_length(rng, self.output_len, self.output_dist, self.spread)
        if self.dataset is not None:
            item = self.dataset[i % len(self.dataset)]
            prompt, messages = item.prompt, item.messages
            if self.chat and messages is None:
                messages = [{"role": "user", "content": prompt}]
            return RequestSpec(prompt if not self.chat else None, messages if self.chat else None,
                               item.max_tokens or max_tokens, item.priority or priority)
        text = synthetic_prompt(rng, sample_length(rng, self.input_len, self.input_dist, self.spread))
        if self.chat:
            return RequestSpec(messages=[{"role": "user", "content": text}], max_tokens=max_tokens, priority=priority)
        return RequestSpec(prompt=text, max_tokens=max_tokens, priority=priority)


def load_dataset(path: Path | str) -> list[RequestSpec]:
    """A JSONL file, one request per line: `prompt` (a string) or `messages` (a chat list),
    optional `max_tokens` and `priority`. Blank lines are skipped; a bad line is a ValueError
    naming it."""
    specs = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the dataset {path}: {e.strerror or e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        prompt, messages = item.get("prompt"), item.get("messages")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"{where}: `prompt` must be a string")
        if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise ValueError(f"{where}: `messages` must be a list of objects")
        if prompt is None and not messages:
            raise ValueError(f"{where}: needs `prompt` or `messages`")
        max_tokens = item.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
            raise ValueError(f"{where}: `max_tokens` must be a positive integer")
        priority = item.get("priority")
        specs.append(RequestSpec(prompt, messages, max_tokens, None if priority is None else str(priority)))
    if not specs:
        raise ValueError(f"the dataset {path} has no requests")
    return specs


# ---------------------------------------------------------------------------------- arrivals


def arrival_times(
    rate: float, burstiness: float = 1.0, *, seed: int = 0, n: int | None = None, duration: float | None = None,
) -> list[float]:
    """Open-loop send times (seconds from the start, the first at 0): gaps drawn from a gamma
    distribution with shape `burstiness` and mean 1/rate, as vLLM (1.0 is a Poisson process,
    below 1 burstier, above 1 more regular). `n` times, or every time before `duration`."""
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if n is None and duration is None:
        raise ValueError("arrival_times needs n or duration")
    rng = random.Random(f"inferd-bench-arrivals:{seed}:{rate}:{burstiness}")
    times, t = [], 0.0
    while (n is None or len(times) < n) and (duration is None or t < duration):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times
