"""`inferd bench --workload conversation`: agent-like multi-turn sessions under one shared system
prompt, each turn's context the last one's plus its answer and a new tool result.

    turn 1   [system: S] [user: task]                                       → answer 1
    turn 2   [system: S] [user: task] [assistant: answer 1] [user: tool 1]   → answer 2
      ...
    turn T   [system: S] [user: task] ... [assistant: answer T−1] [user: tool T−1] → answer T
             |<- S: the same text in every conversation (a prefix cache shares it)
                          |<- the conversation's own, from its first token after S: a task tag

C conversations run at once (a closed loop): each sends its next turn when the last one's stream
has ended, with the answer's text as it was streamed back; after T turns (or a failed turn) the
conversation ends and the next one starts, while the run's request budget (--num-requests or
--duration) lasts. Conversation k's task, tool results (uniform(--tool-tokens) tokens each) and
answer lengths (max_tokens, uniform(--answer-tokens)) are a pure function of (seed, stream, k);
S of the seed alone. Token counts are nominal (bench_workload: 0.75 words a token); the server's
usage gives the real ones (SmolLM2's tokenizer counts ~0.85 of the nominal on this prose).

Sizing: the defaults (1250-token system prompt, a 200-token task, 300–800-token tool results,
64–200-token answers, 7 turns) grow a context to ~5.7k tokens on average, at most 7,650 with every
length at its maximum; options whose maximum passes 8192 less a margin are refused.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inferd.client.bench_metrics import RequestRecord, stats
from inferd.client.bench_workload import RequestSpec, synthetic_prompt

DEFAULT_TURNS = 7
DEFAULT_SYSTEM_TOKENS = 1250
DEFAULT_TOOL_TOKENS = (300, 800)
DEFAULT_ANSWER_TOKENS = (64, 200)
TASK_TOKENS = 200  # the first user message: ~1.45k tokens of first-turn prompt with the system prompt
CONTEXT_TOKENS = 8192  # the context length the workload is sized for (the default model's)
# NOTE: the margin covers the chat template (a few tokens a message, ~16 messages) and the
# nominal count's error; an answer re-tokenized when sent back costs about what it was generated in.
MARGIN_TOKENS = 256
MAX_CONTEXT = CONTEXT_TOKENS - MARGIN_TOKENS


def parse_range(text: str, option: str) -> tuple[int, int]:
    """`300-800` → (300, 800); `64` → (64, 64); ValueError naming `option` otherwise."""
    lo, sep, hi = text.strip().partition("-")
    try:
        bounds = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ValueError(f"{option} takes MIN-MAX tokens (e.g. 300-800) or one number, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{option} needs 1 ≤ MIN ≤ MAX tokens, got {text!r}")
    return bounds


@dataclass(frozen=True)
class ConversationShape:
    """The options of a conversation: turns, and nominal token counts ((min, max) are uniform)."""

    turns: int = DEFAULT_TURNS
    system_tokens: int = DEFAULT_SYSTEM_TOKENS
    tool_tokens: tuple[int, int] = DEFAULT_TOOL_TOKENS
    answer_tokens: tuple[int, int] = DEFAULT_ANSWER_TOKENS

    def context(self, turns: int) -> int:
        """The most tokens turn `turns` can hold, prompt and answer: every length at its maximum."""
        step = self.tool_tokens[1] + self.answer_tokens[1]  # an answer sent back and a tool result
        return self.system_tokens + TASK_TOKENS + (turns - 1) * step + self.answer_tokens[1]

    def check(self) -> None:
        """ValueError naming the option for anything out of range, or a worst case over MAX_CONTEXT."""
        if self.turns < 1:
            raise ValueError(f"--turns must be ≥ 1, got {self.turns}")
        if self.system_tokens < 1:
            raise ValueError(f"--system-tokens must be ≥ 1, got {self.system_tokens}")
        for option, (lo, hi) in (("--tool-tokens", self.tool_tokens), ("--answer-tokens", self.answer_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{option} needs 1 ≤ MIN ≤ MAX tokens, got {lo}-{hi}")
        worst = self.context(self.turns)
        if worst > MAX_CONTEXT:
            fits = next((t for t in range(self.turns - 1, 0, -1) if self.context(t) <= MAX_CONTEXT), 0)
            advice = f"use --turns {fits} or fewer, or shorter lengths" if fits else "shorten the lengths"
            raise ValueError(
                f"--turns {self.turns} with --system-tokens {self.system_tokens}, --tool-tokens "
                f"{self.tool_tokens[0]}-{self.tool_tokens[1]} and --answer-tokens {self.answer_tokens[0]}-"
                f"{self.answer_tokens[1]} reach {worst:,} tokens of context at most (a {TASK_TOKENS}-token "
                f"task, every length at its maximum), over {MAX_CONTEXT:,} ({CONTEXT_TOKENS:,} less "
                f"{MARGIN_TOKENS} for chat templates and the token estimate): {advice}"
            )


@dataclass(frozen=True)
class Conversation:
    """One conversation's own content: its task, a tool result for every turn after the first,
    and every turn's answer length (max_tokens)."""

    index: int
    task: str
    tools: tuple[str, ...]  # turns − 1
    answer_tokens: tuple[int, ...]  # turns

    @property
    def turns(self) -> int:
        return len(self.answer_tokens)


class ConversationWorkload:
    """The shared system prompt, conversation k's content, and turn n's request."""

    def __init__(self, shape: ConversationShape, seed: int = 0) -> None:
        shape.check()
        self.shape, self.seed = shape, seed
        # NOTE: the seed alone, not the stream: warm-ups leave it in a prefix cache, as an agent
        # server's steady state would have it.
        self.system = synthetic_prompt(random.Random(f"inferd-bench-system:{seed}"), shape.system_tokens)

    def conversation(self, index: int, stream: str = "run") -> Conversation:
        """Conversation `index` of `stream` ("warmup", "point0", ...): the same for the same seed."""
        rng = random.Random(f"inferd-bench-conversation:{self.seed}:{stream}:{index}")
        shape = self.shape
        tag = f"{rng.getrandbits(48):012x}"  # the conversation's first tokens after the system prompt
        task = f"Task {tag}: {synthetic_prompt(rng, TASK_TOKENS)}"
        tools = tuple(f"Tool result {tag}.{n}:\n{synthetic_prompt(rng, rng.randint(*shape.tool_tokens))}"
                      for n in range(1, shape.turns))
        answers = tuple(rng.randint(*shape.answer_tokens) for _ in range(shape.turns))
        return Conversation(index, task, tools, answers)

    def messages(self, conversation: Conversation, answers: Sequence[str]) -> list[dict[str, Any]]:
        """Turn len(answers) + 1's messages, given the answers streamed back so far."""
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": conversation.task}]
        for answer, tool in zip(answers, conversation.tools, strict=False):
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": tool}]
        return messages

    def spec(self, conversation: Conversation, answers: Sequence[str]) -> RequestSpec:
        return RequestSpec(messages=self.messages(conversation, answers),
                           max_tokens=conversation.answer_tokens[len(answers)])


# ---------------------------------------------------------------------------------- running

# send(request index, spec, turn, conversation index) → (its record, whether to keep sending)
Send = Callable[[int, RequestSpec, int, int], Awaitable[tuple[RequestRecord, bool]]]


async def conversation_loop(
    n_conversations: int, workload: ConversationWorkload, stream: str, send: Send,
    num: int | None, deadline: float | None,
) -> None:
    """`n_conversations` conversations at once, one after another in each slot, until `num`
    requests were sent or `deadline` (perf_counter) passed; `send` returning False stops all."""
    requests, conversations = itertools.count(), itertools.count()
    stop = False

    async def slot() -> None:
        nonlocal stop
        while not stop:
            conversation = workload.conversation(next(conversations), stream)
            answers: list[str] = []
            for turn in range(1, conversation.turns + 1):
                i = next(requests)
                if stop or (num is not None and i >= num) or (deadline is not None and time.perf_counter() >= deadline):
                    stop = True
                    return
                record, go_on = await send(i, workload.spec(conversation, answers), turn, conversation.index)
                if not go_on:
                    stop = True
                    return
                if not record.ok:
                    break  # a failed turn ends its conversation: the next one starts
                answers.append(record.text)

    await asyncio.gather(*(slot() for _ in range(n_conversations)))


# ---------------------------------------------------------------------------------- metrics


def summarize_turns(records: Sequence[RequestRecord], turns: int) -> dict[str, Any]:
    """The conversation figures over completed requests: TTFT of first turns and of later turns
    apart (a later turn's prompt is mostly cached, or not), later turns' mean prompt tokens (the
    server's usage), and conversations started and finished (all `turns` turns completed)."""
    done = [r for r in records if r.ok and r.turn is not None]
    first = [r.ttft for r in done if r.turn == 1 and r.ttft is not None]
    later = [r.ttft for r in done if r.turn != 1 and r.ttft is not None]
    prompts = [r.prompt_tokens for r in done if r.turn != 1 and r.prompt_tokens is not None]
    return {
        "ttft_first_turn": stats(first),
        "ttft_later_turns": stats(later),
        "prompt_tokens_later_turns_mean": sum(prompts) / len(prompts) if prompts else None,
        "conversations": {
            "turns": turns,
            "started": len({r.conversation for r in records if r.turn is not None}),
            "finished": sum(r.turn == turns for r in done),
            "first_turns": len(first),
            "later_turns": len(later),
        },
    }
