"""`inferd bench --workload agent`: coding-agent sessions, shaped like what an agent CLI sends. One
shared system prompt (rules and the tools' JSON function definitions), a task, tool results that
grow the context (files read, commands run), and two turns a session whose answer is mostly a copy
of a file in the context: what speculative decoding from the context is for.

    turn 1  [system: S] [user: task]                                             → a plan
    turn 2  … [assistant: plan] [user: read_file → file A]                          → an answer
    turn 3  … [assistant] [user: run_command → test output]                         → an answer
    turn 4  … [assistant] [user: read_file → file B; "rename f in it, whole file"]  → B again (copy turn)
    turn 5  … [assistant] [user: run_command → test output]                         → an answer
    turn 6  … [assistant] [user: git diff --stat; "now A, h renamed, whole file"]   → A again (copy turn)
             |<- S: the same text in every session (a prefix cache shares it)
                          |<- the session's own, from its first token after S: a task tag

It runs in bench_conversation's loop (C sessions at once, a closed loop, each turn sent with the
answers as they were streamed back). Session k's task, files, command outputs and answer lengths
are a pure function of (seed, stream, k); S of the seed alone. A copy turn's max_tokens is enough
for its whole file and the fences (COPY_CHARS_PER_TOKEN); other answers' uniform(answer_tokens).

Token counts are nominal: prose 0.75 words a token (bench_workload), code CODE_CHARS_PER_TOKEN
characters a token (SmolLM2's tokenizer: 3.3-3.5 on these files), command output
LOG_CHARS_PER_TOKEN; the server's usage gives the real counts. With SmolLM2's tokenizer the
defaults make a ~1.17k-token system prompt and reach ~5.7k tokens of context at turn 6 on average
(6.3k the most of 30 sessions; 6.5k nominal at most, every length at its maximum).

Reported beside the usual summary: TTFT of first turns, later turns (all of turns 2+, as the
conversation workload), and copy turns and the other later turns apart; each copy / other turn's
decode speed ((output tokens − 1) / (e2e − TTFT)); the prefix cache's share of the prompt tokens
(usage.prompt_tokens_details.cached_tokens); and speculation's acceptance (inferd's usage
extension `speculative`: accepted / drafted tokens), where the server reports them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text

from inferd.client.bench_conversation import MAX_CONTEXT, summarize_turns
from inferd.client.bench_metrics import RequestRecord, stats
from inferd.client.bench_workload import RequestSpec, synthetic_prompt

TURNS = 6
COPY_TURNS = (4, 6)  # turns whose answer copies a file of the context
CODE_CHARS_PER_TOKEN = 3.4
LOG_CHARS_PER_TOKEN = 2.4  # command output (runs of "=", paths, numbers)
# a copy turn's max_tokens: its file at COPY_CHARS_PER_TOKEN (fewer than any file measured, 3.3), and the fences
COPY_CHARS_PER_TOKEN = 3.2
COPY_EXTRA = 8
TASK_TOKENS = 120
INSTRUCTION_TOKENS = 48  # a copy turn's instruction, and turn 6's `git diff --stat`, at most
DIFF_TOKENS = 120

# ---------------------------------------------------------------------------------- the shape


@dataclass(frozen=True)
class AgentShape:
    """A session's nominal token counts ((min, max) are uniform)."""

    system_tokens: int = 1300  # rules and tool schemas (~1.0k real tokens), filled up with project notes
    file_tokens: tuple[int, int] = (550, 850)  # each of the two files read
    command_tokens: tuple[int, int] = (250, 450)  # each command's output
    answer_tokens: tuple[int, int] = (48, 128)  # max_tokens of every turn but the copy turns

    def context(self) -> int:
        """The most tokens turn 6 can hold, prompt and answer: every length at its maximum."""
        answer, file, command = self.answer_tokens[1], self.file_tokens[1], self.command_tokens[1]
        copy = round(file * CODE_CHARS_PER_TOKEN / COPY_CHARS_PER_TOKEN) + COPY_EXTRA
        return (self.system_tokens + TASK_TOKENS + 4 * answer + 2 * file + 2 * command + 2 * INSTRUCTION_TOKENS
                + DIFF_TOKENS + 2 * copy)

    def check(self) -> None:
        """ValueError for anything out of range, or a worst case over MAX_CONTEXT."""
        if self.system_tokens < 1:
            raise ValueError(f"the agent workload's system prompt must be ≥ 1 token, got {self.system_tokens}")
        for name, (lo, hi) in (("file", self.file_tokens), ("command", self.command_tokens),
                               ("answer", self.answer_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"the agent workload's {name} tokens need 1 ≤ MIN ≤ MAX, got {lo}-{hi}")
        if self.context() > MAX_CONTEXT:
            raise ValueError(f"the agent workload reaches {self.context():,} tokens of context at most, "
                             f"over {MAX_CONTEXT:,}: shorten its lengths")


# ---------------------------------------------------------------------------------- content

TOOLS = (  # (name, description, {parameter: (JSON type, description)}, required)
    ("read_file", "Read a file of the repository; returns its text with the path on the first line.",
     {"path": ("string", "the file's path from the repository root"),
      "start_line": ("integer", "the first line to return (1-based; default 1)"),
      "end_line": ("integer", "the last line to return (default: the end of the file)")}, ["path"]),
    ("write_file", "Create or overwrite a file with the given text. Prefer edit_file for small changes.",
     {"path": ("string", "the file's path from the repository root"),
      "content": ("string", "the whole new text of the file")}, ["path", "content"]),
    ("edit_file", "Replace one exact occurrence of old_text with new_text in a file.",
     {"path": ("string", "the file's path"), "old_text": ("string", "text that occurs exactly once in the file"),
      "new_text": ("string", "its replacement")}, ["path", "old_text", "new_text"]),
    ("run_command", "Run a shell command in the repository root and return its exit code and output.",
     {"command": ("string", "the command line, e.g. `pytest -q tests/test_io.py`"),
      "timeout_s": ("integer", "seconds before the command is stopped (default 120)")}, ["command"]),
    ("search", "Search the repository for a regular expression; returns matching lines as path:line:text.",
     {"pattern": ("string", "a Python regular expression"),
      "glob": ("string", "only files whose path matches this glob, e.g. `src/**/*.py`")}, ["pattern"]),
    ("list_dir", "List the entries of a folder, folders first, with file sizes in bytes.",
     {"path": ("string", "the folder's path (default: the repository root)"),
      "depth": ("integer", "how many levels to descend (default 1)")}, []),
    ("git_diff", "Show the working tree's changes against HEAD as a unified diff.",
     {"paths": ("array", "only these paths (default: all)"), "stat": ("boolean", "only the summary per file")}, []),
    ("finish", "End the task with a short summary of what was changed and why.",
     {"summary": ("string", "two or three sentences for the user")}, ["summary"]),
)

RULES = """You are a coding agent working in a software repository on the user's behalf. Work in small,
verifiable steps: read the code before changing it, run the tests after every change, and report
what you did. To use a tool, answer with one JSON object {"tool": NAME, "arguments": {...}} and
nothing else; its result comes back in the next message. When asked to output a file, output all
of it in one fenced code block, unchanged except for the edit asked for. Never invent file
contents, command output or test results.

Tools (JSON function definitions):
"""

VERBS = ("load", "parse", "build", "merge", "render", "check", "update", "fetch", "split", "apply", "resolve",
         "collect", "encode", "decode", "normalize", "schedule", "flush", "validate", "compute", "format")
NOUNS = ("config", "record", "block", "token", "batch", "request", "cache", "entry", "report", "header", "window",
         "segment", "payload", "index", "table", "queue", "event", "limit", "budget", "layout")
MODULES = ("io", "core", "cache", "sched", "wire", "store", "text", "util", "plan", "stats")
TYPES = ("int", "str", "float", "bool", "list[str]", "dict[str, int]", "bytes", "None")
SUITES = ("test_roundtrip", "test_limits", "test_empty", "test_order", "test_unicode", "test_large", "test_merge")


def tool_schemas() -> str:
    """The tools in OpenAI's function format, one JSON object per line."""
    tools = [{"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": required, "properties": {
            key: {"type": kind, "description": text} for key, (kind, text) in params.items()}}}}
        for name, description, params, required in TOOLS]
    return "\n".join(json.dumps(tool) for tool in tools)


def system_prompt(seed: int, tokens: int) -> str:
    """RULES, the tool schemas, and project notes (prose, seeded) filling it to ~`tokens` tokens."""
    head = RULES + tool_schemas()
    used = nominal_code_tokens(head)
    notes = synthetic_prompt(random.Random(f"inferd-bench-agent-system:{seed}"), max(1, tokens - used))
    return f"{head}\n\nProject notes: {notes}"


def nominal_code_tokens(text: str) -> int:
    return round(len(text) / CODE_CHARS_PER_TOKEN)


def _name(rng: random.Random) -> str:
    return f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"


def _function(rng: random.Random, name: str, calls: Sequence[str]) -> list[str]:
    """A Python function of 6-14 lines that may call earlier ones."""
    args = rng.sample(NOUNS, rng.randint(1, 3))
    var, other = rng.sample(NOUNS, 2)
    lines = [f"def {name}({', '.join(f'{a}: {rng.choice(TYPES)}' for a in args)}) -> {rng.choice(TYPES)}:",
             f'    """{name.replace("_", " ").capitalize()} from the {args[0]}, checking its {var}."""',
             f"    {var} = {rng.choice(calls) if calls else 'len'}({args[0]})"]
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(2, 512)
        lines += rng.choice((
            [f"    if {var} > {n}:", f'        raise ValueError(f"{{{var}}} is over {n} in {name}")'],
            [f"    for item in {args[-1]}:", f"        {other}_{n} = item.{rng.choice(NOUNS)} + {n}"],
            [f"    {other} = {rng.choice(calls) if calls else 'sorted'}({var}, {n})"],
            [f"    {var} = [x for x in {args[0]} if x % {n}]", f"    assert {var}, 'empty {var}'"],
        ))
    return [*lines, f"    return {rng.choice((var, other, args[0]))}", "", ""]


@dataclass(frozen=True)
class SourceFile:
    path: str
    text: str
    functions: tuple[str, ...]  # the names it defines, in order

    @property
    def tokens(self) -> int:
        return nominal_code_tokens(self.text)


def source_file(rng: random.Random, tokens: int) -> SourceFile:
    """A Python module of ~`tokens` nominal tokens: imports, a constant, functions calling earlier ones."""
    module = rng.choice(MODULES)
    lines = [f'"""The {module} layer: {rng.choice(NOUNS)}s and {rng.choice(NOUNS)}s."""', "",
             "from __future__ import annotations", "", "import math", "from dataclasses import dataclass", "",
             f"MAX_{rng.choice(NOUNS).upper()} = {rng.randint(8, 4096)}", "", ""]
    names: list[str] = []
    while nominal_code_tokens("\n".join(lines)) < tokens:
        name = _name(rng)
        if name in names:
            continue
        lines += _function(rng, name, names)
        names.append(name)
    return SourceFile(f"src/pkg/{module}_{rng.randrange(100)}.py", "\n".join(lines).rstrip() + "\n", tuple(names))


def command_output(rng: random.Random, tokens: int, source: SourceFile) -> str:
    """~`tokens` of a test run's output about `source`: progress lines, a failure, a summary."""
    tests = f"tests/test_{source.path.rsplit('/', 1)[1]}"
    lines = ["$ pytest -q " + tests, "============================= test session starts =============================",
             "platform linux -- Python 3.11.9, pytest-8.3.4", f"collected {rng.randint(20, 90)} items", ""]
    while len("\n".join(lines)) / LOG_CHARS_PER_TOKEN < tokens - 60:
        name, suite = rng.choice(source.functions), rng.choice(SUITES)
        outcome = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED"))
        lines.append(f"{tests}::{suite}_{name}[{rng.randint(0, 63)}] {outcome}  [{rng.randint(1, 99):3d}%]")
    failed = rng.choice(source.functions)
    lines += ["", "=================================== FAILURES ===================================",
              f"    def test_{failed}():", f">       assert {failed}({rng.randint(1, 99)}) == {rng.randint(1, 99)}",
              f"E       AssertionError: assert {rng.randint(100, 999)} == {rng.randint(1, 99)}",
              f"{source.path}:{rng.randint(10, 200)}: AssertionError",
              f"=========== 1 failed, {rng.randint(20, 90)} passed in {rng.uniform(0.5, 9):.2f}s ==========="]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- sessions


@dataclass(frozen=True)
class AgentSession:
    """One session's content: the task, the user message of turns 2..6, every turn's max_tokens."""

    index: int
    task: str
    tools: tuple[str, ...]  # TURNS − 1
    answer_tokens: tuple[int, ...]  # TURNS

    @property
    def turns(self) -> int:
        return len(self.answer_tokens)


def _copy_request(rng: random.Random, source: SourceFile) -> tuple[str, str, int]:
    """(the instruction, the function renamed, the answer's max_tokens) for a copy turn on `source`."""
    old = rng.choice(source.functions)
    new = f"{old}_v{rng.randint(2, 9)}"
    instruction = (f"Rewrite the file {source.path} with the function `{old}` renamed to `{new}` (its definition "
                   "and every call). Output the whole file in one code block and nothing else.")
    return instruction, old, round(len(source.text) / COPY_CHARS_PER_TOKEN) + COPY_EXTRA


class AgentWorkload:
    """The shared system prompt, session k's content, and turn n's request (the interface of
    bench_conversation's ConversationWorkload, so its loop runs both)."""

    copy_turns = COPY_TURNS
    turns = TURNS

    def __init__(self, shape: AgentShape = AgentShape(), seed: int = 0) -> None:
        shape.check()
        self.shape, self.seed = shape, seed
        self.system = system_prompt(seed, shape.system_tokens)

    def conversation(self, index: int, stream: str = "run") -> AgentSession:
        """Session `index` of `stream` ("warmup", "point0", ...): the same for the same seed."""
        rng = random.Random(f"inferd-bench-agent:{self.seed}:{stream}:{index}")
        shape = self.shape
        tag = f"{rng.getrandbits(48):012x}"
        a, b = (source_file(rng, rng.randint(*shape.file_tokens)) for _ in range(2))
        task = (f"Task {tag}: the tests of {a.path} fail since the last change to `{a.functions[0]}`. "
                f"Find the cause and fix it. {synthetic_prompt(rng, TASK_TOKENS - 40)}")
        copy_b, _, copy_b_tokens = _copy_request(rng, b)
        copy_a, _, copy_a_tokens = _copy_request(rng, a)
        diff = "\n".join(f" {path} | {rng.randint(1, 40)} {'+' * rng.randint(1, 12)}{'-' * rng.randint(0, 6)}"
                         for path in (b.path, a.path, f"tests/test_{a.path.rsplit('/', 1)[1]}"))
        tools = (
            f"Tool result (read_file {a.path}):\n```python\n{a.text}```",
            f"Tool result (run_command):\n{command_output(rng, rng.randint(*shape.command_tokens), a)}",
            f"Tool result (read_file {b.path}):\n```python\n{b.text}```\n\n{copy_b}",
            f"Tool result (run_command):\n{command_output(rng, rng.randint(*shape.command_tokens), b)}",
            f"Tool result (git_diff, stat):\n{diff}\n\nThe tests pass now. {copy_a}",
        )
        answers = [rng.randint(*shape.answer_tokens) for _ in range(TURNS)]
        answers[COPY_TURNS[0] - 1], answers[COPY_TURNS[1] - 1] = copy_b_tokens, copy_a_tokens
        return AgentSession(index, task, tools, tuple(answers))

    def messages(self, session: AgentSession, answers: Sequence[str]) -> list[dict[str, Any]]:
        """Turn len(answers) + 1's messages, given the answers streamed back so far."""
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": session.task}]
        for answer, tool in zip(answers, session.tools, strict=False):
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": tool}]
        return messages

    def spec(self, session: AgentSession, answers: Sequence[str]) -> RequestSpec:
        return RequestSpec(messages=self.messages(session, answers), max_tokens=session.answer_tokens[len(answers)])

    def summarize(self, records: Sequence[RequestRecord]) -> dict[str, Any]:
        return summarize_agent(records, self.copy_turns)


# ---------------------------------------------------------------------------------- metrics


def decode_speed(record: RequestRecord) -> float | None:
    """Output tokens per second after the first token: (output tokens − 1) / (e2e − TTFT)."""
    if not record.ok or record.output_tokens < 2 or record.e2e is None or record.ttft is None:
        return None
    return (record.output_tokens - 1) / (record.e2e - record.ttft) if record.e2e > record.ttft else None


def speculation(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Drafted and accepted tokens summed over the records that reported them; None if none did."""
    reported = [r for r in records if r.drafted_tokens is not None]
    if not reported:
        return None
    drafted = sum(r.drafted_tokens or 0 for r in reported)
    accepted = sum(r.accepted_tokens or 0 for r in reported)
    return {"requests": len(reported), "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None}


def summarize_agent(records: Sequence[RequestRecord], copy_turns: Sequence[int] = COPY_TURNS) -> dict[str, Any]:
    """The conversation workload's turn figures, and the agent's own: copy turns apart, decode
    speeds, the prefix cache's share of prompt tokens, speculation's acceptance."""
    done = [r for r in records if r.ok and r.turn is not None]
    copies = [r for r in done if r.turn in copy_turns]
    others = [r for r in done if r.turn not in copy_turns]
    cached = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    cached_sum, prompt_sum = sum(r.cached_tokens or 0 for r in cached), sum(r.prompt_tokens or 0 for r in cached)
    spec = speculation(done)
    if spec is not None:
        spec |= {"copy_turns": speculation(copies), "other_turns": speculation(others)}
    return summarize_turns(records, TURNS) | {
        "copy_turns": list(copy_turns),
        "ttft_copy_turns": stats([r.ttft for r in copies if r.ttft is not None]),
        "ttft_tool_turns": stats([r.ttft for r in others if r.turn != 1 and r.ttft is not None]),
        "decode_tok_s_copy_turns": stats([s for r in copies if (s := decode_speed(r)) is not None]),
        "decode_tok_s_other_turns": stats([s for r in others if (s := decode_speed(r)) is not None]),
        "output_tokens_copy_turns": sum(r.output_tokens for r in copies),
        "cached_tokens": {"requests": len(cached), "cached": cached_sum, "prompt": prompt_sum,
                          "fraction": cached_sum / prompt_sum if prompt_sum else None} if cached else None,
        "speculation": spec,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def render_agent(summary: dict[str, Any]) -> Text:
    """The agent's own lines, printed under render_run's report."""
    copy, tool = summary["ttft_copy_turns"], summary["ttft_tool_turns"]
    speed = {k: summary[f"decode_tok_s_{k}_turns"]["p50"] for k in ("copy", "other")}
    lines = [f"TTFT p50 / p99 ms: copy turns {_ms(copy['p50'])} / {_ms(copy['p99'])}, other later turns "
             f"{_ms(tool['p50'])} / {_ms(tool['p99'])}; decode p50 tok/s: copy turns {_num(speed['copy'])}, "
             f"other turns {_num(speed['other'])}"]
    cached = summary["cached_tokens"]
    lines.append("cached prompt tokens: " + ("not reported" if cached is None else
                 f"{cached['cached']:,} of {cached['prompt']:,} ({cached['fraction'] or 0:.1%}) over "
                 f"{cached['requests']} requests"))
    spec = summary["speculation"]
    if spec is None:
        lines.append("speculation: not reported")
    else:
        parts = [f"{name} {s['accepted_tokens']:,} / {s['drafted_tokens']:,}" for name, s in
                 (("copy turns", spec["copy_turns"]), ("others", spec["other_turns"])) if s is not None]
        rate = "-" if spec["acceptance"] is None else f"{spec['acceptance']:.1%}"
        lines.append(f"speculation: accepted / drafted {spec['accepted_tokens']:,} / {spec['drafted_tokens']:,} "
                     f"({rate}; {', '.join(parts)})")
    text = Text()
    for line in lines:
        text.append("agent  ", style="dim")
        text.append(line + "\n")
    text.rstrip()
    return text


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"
