"""Sampled tokens -> what a client sees: one `EngineOutput` per choice per step.

    token --detokenize--> text delta --stop strings / stop ids / EOS--> --length--> hooks --> output

Each unfinished choice has an `IncrementalDetokenizer` (UTF-8 held whole, stop strings held
back) and a list of `OutputHook`s: the place where per-request output filters plug in, in
order: the server's blocklist (engine/output/blocklist.py), then the request's segmentation
(engine/output/segmenter.py). The engine thread is the only caller.
"""

from __future__ import annotations

from typing import Protocol

from inferd.engine.output.blocklist import OutputFilter
from inferd.engine.protocol import EngineOutput, TokenLogprob
from inferd.engine.sched.request import Request
from inferd.engine.output.segmenter import segment_hook
from inferd.text.detokenizer import IncrementalDetokenizer
from inferd.model.sampler import SamplerOutput
from inferd.text.tokenizer import Tokenizer


class OutputHook(Protocol):
    """Sees each choice's text as it is released. Returns the text to send now (it may hold some
    back for later calls) and whether the choice must stop here: False, True (finish_reason
    "stop") or the finish reason to end it with ("content_filter"); `final` is the choice's last
    call, where anything held back must be released or dropped."""

    def __call__(self, text: str, final: bool) -> tuple[str, bool | str]: ...


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, output_filter: OutputFilter | None = None) -> None:
        self.tokenizer = tokenizer
        self.output_filter = output_filter  # the server's blocklist, compiled once; None: off
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}  # seq_id -> its detokenizer, while unfinished
        self._hooks: dict[int, list[OutputHook]] = {}  # seq_id -> its hooks, for the seqs that have any

    def add(self, seq: Request, hooks: list[OutputHook] | None = None) -> None:
        self._detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq.params, seq.prompt_ids)
        if hooks:
            self._hooks[seq.seq_id] = list(hooks)

    def hooks(self, segment: str = "token") -> list[OutputHook]:
        """A new choice's own hooks: the blocklist's, then its segmentation's (each holds state)."""
        hooks: list[OutputHook] = [] if self.output_filter is None else [self.output_filter.hook()]
        segmenter = segment_hook(segment)
        if segmenter is not None:
            hooks.append(segmenter)
        return hooks

    def remove(self, seq_id: int) -> None:
        self._detokenizers.pop(seq_id, None)
        self._hooks.pop(seq_id, None)

    def on_token(self, seq: Request, token: int, sampled: SamplerOutput, row: int,
                 later: int = 0) -> tuple[EngineOutput, str | None]:
        """The choice's output for a token it just sampled (`later`: how many more it sampled in
        the same step, already in its output_ids), and how it ends if it does: "stop" (a stop
        condition or a hook), "length" (max_tokens or the context), a hook's own reason
        ("content_filter"), else None."""
        # NOTE: runs once per token of every running choice: kept to plain lookups and one call
        seq_id = seq.seq_id
        constraint_ends = seq.constraint is not None and seq.constraint.accept(token)
        detokenizer = self._detokenizers[seq_id]
        update = detokenizer.step(token)
        out = EngineOutput(seq.group_id, [token], update.text, seq.index)
        if sampled.logprobs is not None and seq.params.logprobs is not None:
            out.logprobs = [TokenLogprob(token, sampled.logprobs[row], sampled.top_logprobs[row])]  # type: ignore[index]
        ending: str | None = None
        if update.finished:
            ending, out.stop_reason = "stop", update.stop_reason
        elif seq.num_tokens - later >= seq.max_total_tokens or constraint_ends:
            ending = "stop" if constraint_ends else "length"
            out.text += detokenizer.flush()
        if self._hooks and seq_id in self._hooks:
            out.text, stopped = self._run_hooks(self._hooks[seq_id], out.text, ending is not None)
            if stopped:
                ending = stopped if isinstance(stopped, str) else ending or "stop"
        return out, ending

    def flush(self, seq_id: int) -> str:
        """The text a choice still holds back, released as it ends early (a timeout)."""
        detokenizer = self._detokenizers.get(seq_id)
        if detokenizer is None:
            return ""
        text, _ = self._run_hooks(self._hooks.get(seq_id, []), detokenizer.flush(), True)
        return text

    @staticmethod
    def _run_hooks(hooks: list[OutputHook], text: str, final: bool) -> tuple[str, bool | str]:
        stopped: bool | str = False
        for hook in hooks:
            text, stop = hook(text, final or bool(stopped))
            stopped = stopped or stop
        return text, stopped
