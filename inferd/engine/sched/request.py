"""The state of one generation request. Only the scheduler changes it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from inferd.engine.protocol import LogitsConstraint, PoolingParams, Session, TokenLogprob
from inferd.text.sampling_params import SamplingParams
from inferd.settings.policy import PriorityClass, Timeouts


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    # finished states: everything from FINISHED_STOPPED on
    FINISHED_STOPPED = 10  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 11  # max_tokens or the model's context
    FINISHED_ABORTED = 12  # cancelled by the caller
    FINISHED_TIMEOUT = 13  # a queue, TTFT, per-token or total timeout (Request.timeout_kind)
    FINISHED_ERROR = 14  # a fault: its own processing raised, or its step's forward failed
    FINISHED_FILTERED = 15  # the output filter stopped it (a blocked term)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` of a finished status."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_TIMEOUT: "timeout",
            RequestStatus.FINISHED_ERROR: "error",
            RequestStatus.FINISHED_FILTERED: "content_filter",
        }.get(self)


@dataclass(eq=False)
class Request:
    seq_id: int  # one choice; the engine hands them out
    prompt_ids: list[int]
    params: SamplingParams
    max_model_len: int  # the model's context: prompt + output never exceed it
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    # n > 1: choice 0 is the request itself; choices 1..n-1 wait in `forks` until its prompt is
    # prefilled, then share its blocks and sample their own first tokens from the same logits
    index: int = 0  # choice index within the group
    group_id: int = -1  # the request id of choice 0 (its own id for choice 0)
    forks: list[Request] = field(default_factory=list)
    # scheduling policy (Scheduler.add fills in what is None)
    priority_class: PriorityClass | None = None  # one of the scheduler's policy (it asserts so)
    rank: int = 0  # the class's position, 0 = most important
    timeouts: Timeouts = field(default_factory=Timeouts)  # the request's own; add() tightens by the class's
    arrival_time: float | None = None  # when it reached the server, on the scheduler's clock
    tenant: str | None = None  # whose share it is served from (fair sharing inside its class)
    tenant_weight: float = 1.0  # that share's weight (the tenant's latest request's counts)
    cache_salt: bytes = b""  # its prefix-cache namespace: it shares cached blocks only within it
    session: Session | None = None  # its prefix is held for its session when it ends (kv/retention.py)
    # timeline, on the scheduler's clock (None: not yet)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # preemption
    swapped: bool = False  # its KV blocks wait in host memory
    progress_mark: int = -1  # len(output_ids) when last resumed; not preempted again until it grows
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at its first admission
    host_cached_tokens: int = 0  # of which the host tier supplied
    cache_miss: str | None = None  # why not more (kv/cache_tiers.py's words)
    token_cap: int | None = None  # load shedding's lower max_tokens, when in force
    paused: bool = False  # its reader is behind: not scheduled, its KV blocks kept
    timeout_kind: str | None = None  # which timeout ended it
    # its own logits constraint (a grammar's matcher), advanced with every token it samples; its
    # state survives a preemption, as the sampled tokens do
    constraint: LogitsConstraint | None = None
    # (params.prompt_logprobs) entry p: prompt token p + 1 given the tokens before it, as the
    # prefill computes them; a recomputed prefill does not add them twice
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # a pooling request (embeddings, scores): its prompt computed, nothing sampled; it finishes
    # when its prompt has been
    pooling: PoolingParams | None = None
    pools_every_token: bool = False  # (mean or cls pooling) every prompt position computed: no cached prefix
    one_chunk: bool = False  # (bidirectional attention) its prompt computed in one step, never in chunks
    # speculative decoding: tokens proposed to follow its last one, verified in its next step, and
    # its totals, drafted and accepted (the engine's speculator, engine/spec/, writes these)
    draft_ids: list[int] = field(default_factory=list)
    draft_history: bool = False  # also from its tenant's recent outputs (EngineRequest.draft_history)
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def reuses_cached_prefix(self) -> bool:
        """False for a request that wants its prompt's logprobs, or pools every position: it
        computes all of its prompt."""
        return self.params.prompt_logprobs is None and not self.pools_every_token

    def __post_init__(self) -> None:
        if self.group_id < 0:
            self.group_id = self.seq_id

    @property
    def forks_pending(self) -> list[Request]:
        """The choices that fork from this request at its first sampled token."""
        return self.forks if not self.output_ids else []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the concatenation."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    @property
    def max_total_tokens(self) -> int:
        max_tokens = self.params.max_tokens if self.token_cap is None else min(self.params.max_tokens, self.token_cap)
        return min(self.max_model_len, len(self.prompt_ids) + max_tokens)
