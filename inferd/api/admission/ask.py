"""What a protocol front-end asks of the shared path, and what the door's checks make of it.

    front-end (wire format)  ->  Ask (the caller's wishes, in the engine's terms, unchecked)
    the front-end's shape    ->  Shaped (for the chosen model: prompts, grammar, thinking)
    the model's door         ->  Prepared (every limit checked once: what the engine runs)

An `Ask` and a `Shaped` name nothing of any wire format and hold plain data: OpenAI's chat and
completions, Anthropic's messages and OpenAI's responses each build them from their own request
body. Everything the engine needs to know comes out of `FrontDoor.prepare` as a `Prepared`;
admission, the charge and the engine take it as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferd.api.errors import APIError
from inferd.api.gateway.tenants import Tenant
from inferd.engine.protocol import LogitsConstraint, PoolingParams, Session
from inferd.settings.policy import PriorityClass, Timeouts
from inferd.text.sampling_params import SamplingParams

# where a request's grammar came from (/metrics counts them; "invalid": it was refused)
# ("tools": only tool calls, tool_choice "required" or named; "tools_auto": text, and any call it starts)
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools", "tools_auto", "invalid")


@dataclass(frozen=True, slots=True)
class Grammar:
    """A structured output's grammar (llguidance's text), where it came from and the field it is named by."""

    text: str
    kind: str  # one of GRAMMAR_KINDS
    param: str  # the request field an error about it names: "response_format", "tools"
    # (opening, closing) of a tool call: the answer ends once a call repeats an earlier one
    repeat_tags: tuple[str, str] | None = None
    ends_answer: bool = True  # the grammar decides where the answer ends (ignore_eos cannot hold)
    # one that is too large, does not compile, or breaks while it runs leaves the answer free
    # (no 400, no failed choice): tools under "auto", where the client asked for no constraint
    best_effort: bool = False


@dataclass(frozen=True, slots=True)
class Thinking:
    """A thinking model's reasoning as the prompt leaves it, and its budget: the closing marker is
    forced once `budget` reasoning tokens are spent (engine/structured/budget.py)."""

    open: str  # the markers' text (conversation/reasoning.py)
    close: str
    inside: bool  # the prompt opened the block (else the answer may)
    budget: int
    closing: str  # what is forced once it is spent: the closing marker, as the template frames it


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling fields every protocol shares (max_tokens and logprobs are the door's to settle)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the answer besides the model's EOS (harmony's)
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias): ids are checked at the door
    prompt_logprobs: int | None = None  # the prompt's own logprobs, top alternatives per token (echo)


@dataclass(frozen=True, slots=True)
class SessionAsk:
    """The session a request names (pipeline/sessions.py reads it from its protocol): the door
    scopes the key to its tenant and settles the TTL (engine/protocol.py's Session)."""

    key: str  # as the client named it (1 to 256 characters), or as its protocol derived it
    ttl: float | None = None  # seconds asked (Anthropic's cache_control ttl); None: cache.session_ttl_seconds


@dataclass(frozen=True, slots=True)
class Ask:
    """One generation request as its front-end states it, before any limit is checked."""

    model: str  # a model, an alias or a route
    n: int = 1  # choices per prompt
    stream: bool = False
    priority: str | int | None = None  # a class name or number; None: the tenant's or the default
    user: str | None = None  # sticky routes, and the request's log line
    max_tokens: int | None = None  # None: limits.max_tokens_default
    fit_default: bool = False  # a default max_tokens is clipped to the context the prompt leaves
    # an asked max_tokens over what the server allows is lowered to it, not refused (Anthropic's
    # clients send 32,000 by default; the reply's x-inferd-max-tokens-clamped header says so)
    clamp_max_tokens: bool = False
    logprobs: int | None = None  # top alternatives per token (0: the chosen token's only); None: none
    sampling: Sampling = Sampling()
    timeouts: Timeouts = Timeouts()  # the request's own; they may tighten its class's, never loosen
    segment: str = "token"  # text released per "token", or in whole "sentence"s or "line"s
    resumable: bool = False  # a stream that outlives a disconnect
    cache_salt: str | None = None  # narrows its prefix-cache namespace (its tenant's) further
    prompt_param: str = "prompt"  # the field an error about the prompt names ("messages" in chat)
    # what the shape made for the chosen model (Shaped's, copied in by the pipeline): the
    # structured output's grammar, or the 400 building it gave (the door refuses it in its turn);
    # None: free text
    grammar: Grammar | Refused | None = None
    thinking: Thinking | None = None  # a thinking model's budget, if one is asked
    # a prompt-only request (embeddings, scores): one choice, nothing sampled, so the generation
    # fields above go unused; the door checks its prompts against what the model reads at once
    pooling: PoolingParams | None = None
    session: SessionAsk | None = None  # keep its prefix cached between turns; None: anonymous blocks
    volatile_blocks: int = 0  # prompt blocks dropped as volatile (conversation/volatile.py), for its usage


@dataclass(frozen=True, slots=True)
class Refused:
    """A grammar a shape could not build for this model: the client's 400, which the door gives
    where it checks the grammar (after the prompts and the limits), counted as invalid."""

    error: APIError


@dataclass(frozen=True, slots=True)
class Shaped:
    """What a front-end's shape makes of one request for the model that answers it (its
    tokenizer and chat template), before any limit is checked: Shape.prepare's result."""

    prompts: list[list[int]]  # one engine request each, with n choices
    # the structured output's grammar (the tool-call format follows the model's chat template);
    # None: free text
    grammar: Grammar | Refused | None = None
    thinking: Thinking | None = None  # a thinking model's budget, if one is asked
    # the tokens that end an answer in the model's format besides its EOS (harmony's <|call|>, <|return|>)
    stop_token_ids: tuple[int, ...] = ()


def build_grammar(make: Callable[[], Grammar | None]) -> Grammar | Refused | None:
    """`make()`, a shape's grammar for this model; the 400 it raises kept as Refused, so that the
    door's earlier checks (prompts, n, max_tokens) still answer first."""
    try:
        return make()
    except APIError as e:
        return Refused(e)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request every check has passed: what the door admits and the engine runs, unchanged."""

    prompts: Sequence[list[int]]  # one engine request each, with n choices
    params: SamplingParams
    n: int
    cls: PriorityClass
    timeouts: Timeouts  # the class's, tightened by the request's own
    segment: str
    constraints: Sequence[LogitsConstraint] | None  # one per prompt, for a structured output
    cache_salt: str | None = None  # the request's own (Ask.cache_salt)
    tenant: Tenant | None = None  # who asks (its fair-share weight and prefix-cache scope); None: no tenant
    pooling: PoolingParams | None = None  # (Ask.pooling) a prompt-only request
    session: Session | None = None  # (Ask.session) scoped to its tenant, its TTL settled; never for pooling

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def cost(self) -> int:
        """The most tokens it can take: its prompts, and max_tokens for every choice (the charge)."""
        return sum(len(p) + self.params.max_tokens * self.n for p in self.prompts)
