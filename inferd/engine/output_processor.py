"""Sampled tokens -> what a client sees: one `EngineOutput` per choice per step.

    token --detokenize--> text delta --stop strings / stop ids / EOS--> --length--> hooks --> output

Each unfinished choice has an `IncrementalDetokenizer` (UTF-8 held whole, stop strings held
back) and a list of `OutputHook`s: the place where per-request output filters plug in. The
engine thread is the only caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from inferd.engine.protocol import EngineOutput, TokenLogprob
from inferd.engine.request import Request
from inferd.model.detokenizer import IncrementalDetokenizer
from inferd.model.sampler import SamplerOutput
from inferd.model.tokenizer import Tokenizer


class OutputHook(Protocol):
    """Sees each choice's text as it is released. Returns the text to send now (it may hold some
    back for later calls) and whether the choice must stop here; `final` is the choice's last
    call, where anything held back must be released or dropped."""

    def __call__(self, text: str, final: bool) -> tuple[str, bool]: ...


@dataclass(slots=True)
class _Choice:
    detokenizer: IncrementalDetokenizer
    hooks: list[OutputHook] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._choices: dict[int, _Choice] = {}  # seq_id -> its output state, while unfinished

    def add(self, seq: Request, hooks: list[OutputHook] | None = None) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params, seq.prompt_ids)
        self._choices[seq.seq_id] = _Choice(detokenizer, hooks or [])

    def remove(self, seq_id: int) -> None:
        self._choices.pop(seq_id, None)

    def on_token(self, seq: Request, token: int, sampled: SamplerOutput, row: int) -> tuple[EngineOutput, str | None]:
        """The choice's output for the token it just sampled, and how it ends if it does:
        "stop" (a stop condition or a hook), "length" (max_tokens or the context), else None."""
        choice = self._choices[seq.seq_id]
        if seq.constraint is not None:
            seq.constraint.accept(token)
        update = choice.detokenizer.step(token)
        out = EngineOutput(seq.group_id, [token], update.text, index=seq.index)
        if seq.params.logprobs is not None:
            out.logprobs = [TokenLogprob(token, sampled.logprobs[row], sampled.top_logprobs[row])]
        ending: str | None = None
        if update.finished:
            ending, out.stop_reason = "stop", update.stop_reason
        elif seq.num_tokens >= seq.max_total_tokens:
            ending = "length"
            out.text += choice.detokenizer.flush()
        if choice.hooks:
            out.text, stopped = self._run_hooks(choice, out.text, ending is not None)
            if stopped and ending is None:
                ending = "stop"
        return out, ending

    def flush(self, seq_id: int) -> str:
        """The text a choice still holds back, released as it ends early (a timeout)."""
        choice = self._choices.get(seq_id)
        if choice is None:
            return ""
        text, _ = self._run_hooks(choice, choice.detokenizer.flush(), True)
        return text

    @staticmethod
    def _run_hooks(choice: _Choice, text: str, final: bool) -> tuple[str, bool]:
        stopped = False
        for hook in choice.hooks:
            text, stop = hook(text, final or stopped)
            stopped |= stop
        return text, stopped
