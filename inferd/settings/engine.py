"""The engine's settings tables: [model], [cache], [scheduler], [shedding], [classes.NAME], [limits],
[health] and [runtime]. Each key's docstring is its one description: docs/configuration.md,
`inferd config --defaults` and the `serve` flags are made from it (settings/docs.py, defaults.py,
flags.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from inferd.settings.policy import DEFAULT_CLASSES, PriorityClass, SchedulingPolicy, ShedConfig, Timeouts
from inferd.settings.values import AUTO_SIZE, SIZE, Section, parse_memory


class ModelSettings(Section):
    """The model served (without [models.NAME] tables, the only one)."""

    path: str | None = Field(default=None, examples=["/srv/models/Qwen3-8B-Q4_K_M.gguf"])
    """GGUF file or Hugging Face folder (config.json, *.safetensors, tokenizer.json or tokenizer.model);
    unset: the embedded SmolLM2-135M-Instruct (Q4_1 GGUF)."""
    name: str | None = Field(default=None, examples=["qwen3-8b"])
    """The name clients send; unset: the file or folder name."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The weights' and activations' dtype; auto: bfloat16."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when torch sees a device, else the CPU."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length cap (prompt + answer); unset: the model's own."""
    cuda_graphs: bool = True
    """CUDA only: replay decode steps from graphs captured at start-up."""
    weights: Literal["auto", "bf16", "int8", "int4"] = "auto"
    """CPU: the linear layers' weights packed (inferd/model/layers/quant.py); auto: as the GGUF stores them."""
    deterministic: bool = True
    """CPU, bfloat16: every request's tokens the same whatever runs beside it (batch-invariant kernels)."""
    task: Literal["generate", "embed", "score"] = "generate"
    """What it serves: text ("generate"), vectors ("embed": /v1/embeddings) or relevance ("score":
    /v1/rerank and /v1/score, a Qwen3-Reranker-style yes/no model)."""
    pooling: Literal["last", "mean", "cls"] | None = None
    """How /v1/embeddings pools the hidden states; unset: the checkpoint's sentence-transformers
    modules, else "mean" ("last" for Qwen3-Embedding)."""
    normalize: bool | None = None
    """Embeddings scaled to length 1; unset: the checkpoint's modules say, else yes."""
    embeddings: bool = True
    """A "generate" model answers /v1/embeddings too (pooled as above); false: 400."""


class CacheSettings(Section):
    """The paged KV cache."""

    block_size: int = Field(default=16, ge=1, le=128)
    """Tokens per KV block (a power of two)."""
    kv_cache_memory: float | None = Field(default=None, json_schema_extra=AUTO_SIZE)
    """KV cache size: bytes like "2GiB", or a fraction of free memory; "auto" (unset): 2 GiB on the
    host, most of the free memory on CUDA. More KV memory: more requests at once, and longer ones."""
    prefix_caching: bool = True
    """Reuse cached KV blocks of shared prompt prefixes."""
    swap_space: float = Field(default=2**30, json_schema_extra=SIZE)
    """Host memory for swapped-out blocks (scheduler.preemption_mode "swap"), bytes like "1GiB"."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """K/V storage: "auto", the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2", 8 bits with a
    power-of-two scale per token and KV head: about twice the tokens in the same memory, at a
    small cost in quality (bench/RESULTS.md, issue 43)."""
    kv_host_cache_memory: float | None = Field(default=None, json_schema_extra=AUTO_SIZE)
    """A host-memory tier for the prefix cache: blocks evicted from the KV cache are kept there and
    come back on a hit, bytes like "8GiB"; 0: none. "auto" (unset): none on a CPU-only box (the
    KV cache is host memory already: give it the bytes instead), 8 GiB or a quarter of the free
    host memory, the less, on CUDA."""
    session_ttl_seconds: float = Field(default=300, ge=0, le=86400)
    """How long a session's newest prefix (prompt_cache_key, x-session-id, Anthropic's
    cache_control) is kept ahead of anonymous blocks after its last request; cache_control's
    "ttl" may ask for longer, up to session_max_ttl_seconds."""
    session_max_ttl_seconds: float = Field(default=3600, ge=0, le=86400)
    """The longest a request may ask its session to be kept."""
    session_share: float = Field(default=0.5, gt=0, le=1)
    """The share of the KV cache one tenant's sessions may hold ahead of anonymous blocks (the
    whole cache when no tenants are configured)."""
    volatile_prompt_patterns: tuple[str, ...] = ("^x-anthropic-billing-header:",)
    """Regular expressions: a system or message text block that matches one is dropped from the
    prompt before tokenizing (it changes on every request and would defeat the prefix cache:
    Claude Code's billing header). A change of the model's input; () turns it off."""

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two in [1, 128]")
        return value

    @field_validator("kv_cache_memory", "swap_space", "kv_host_cache_memory", mode="before")
    @classmethod
    def _memory(cls, value: Any, info: ValidationInfo) -> float | None:
        if info.field_name != "swap_space" and (value is None or value == "auto"):
            return None
        return parse_memory(value)


class SchedulerSettings(Section):
    """Continuous batching: how many run at once, and in what order."""

    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    """Sequences per batch at most."""
    max_num_batched_tokens: int = Field(default=512, ge=16, le=1 << 20)
    """Tokens per engine step at most (prefill chunks and decodes together)."""
    default_class: str = SchedulingPolicy().default_class
    """The priority class of a request that names none."""
    pooling_class: str | None = None
    """The class of an embedding, rerank or score request that names none; unset: the least
    important class (so a flood of them cannot starve chat)."""
    pooling_step_tokens: int = Field(default=SchedulingPolicy().pooling_step_tokens, ge=1, le=1 << 20)
    """Their prompt tokens per engine step at most, and none in a step that computes a generation's
    prompt (a bidirectional model's prompt runs whole): a chat's first token never waits behind a
    long step of embeddings."""
    aging_seconds: float = Field(default=SchedulingPolicy().aging_seconds, ge=0)
    """A waiting request's rank improves by one class per this many seconds (no starvation); 0: off."""
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    """A preempted request frees its blocks and recomputes later, or has them copied to host memory."""
    fairness: Literal["vtc", "fcfs"] = "vtc"
    """Inside a class: "vtc" serves the backlogged tenant with the fewest tokens served per weight
    first; "fcfs" by arrival (and deadline) alone."""


class SpeculativeSettings(Section):
    """Speculative decoding without a draft model: tokens a request is likely to copy (from its
    prompt and its output so far) are verified several at a time in one forward. Lossless: the
    tokens are those decoding one at a time would give (greedy token for token; sampled in
    distribution)."""

    method: Literal["auto", "suffix", "ngram", "off"] = "auto"
    """"suffix": drafts from the longest earlier occurrence of the text's end (suffix decoding);
    "ngram": from the last few tokens' latest occurrence (prompt lookup); "auto": suffix, only in
    steps and for requests where it pays (few requests at once, drafts being accepted)."""
    max_draft_tokens: int = Field(default=8, ge=1, le=64)
    """Draft tokens a request verifies in one step at most."""
    max_batch: int = Field(default=8, ge=1, le=4096)
    """"auto": no drafts in a step with more requests decoding than this (verification then costs
    more than it saves)."""
    history_tokens: int = Field(default=1 << 16, ge=0, le=1 << 24)
    """A tenant's recent outputs kept to draft from, in tokens, for tenants with
    speculative_history = true (never shared between tenants)."""


_SHED = ShedConfig()  # the defaults


class SheddingSettings(Section):
    """Load shedding: when a protected (non-sheddable) class's p95 TTFT nears its target, the
    sheddable classes are shed one level at a time (1: their new requests get 429; 2: they run at
    most `max_running`; 3: their max_tokens is lowered to `max_tokens`)."""

    enabled: bool = _SHED.enabled
    """Shed the sheddable classes under load."""
    margin: float = Field(default=_SHED.margin, ge=0, lt=1)
    """Act when p95 TTFT > (1 - margin) x the protected class's ttft_target."""
    window_seconds: float = Field(default=_SHED.window_seconds, gt=0)
    """The sliding window of TTFT samples."""
    min_samples: int = Field(default=_SHED.min_samples, ge=1)
    """Fewer samples in the window: no opinion (clear)."""
    escalate_seconds: float = Field(default=_SHED.escalate_seconds, ge=0)
    """At least this long between two escalations."""
    recover_seconds: float = Field(default=_SHED.recover_seconds, ge=0)
    """Clear this long before each step down (hysteresis)."""
    max_running: int = Field(default=_SHED.max_running, ge=0)
    """Level 2: sequences a sheddable class runs at most (the rest are preempted)."""
    max_tokens: int = Field(default=_SHED.max_tokens, ge=1)
    """Level 3: a sheddable request's max_tokens is lowered to this."""


class ClassSettings(Section):
    """One priority class; timeouts in seconds, 0 meaning none."""

    priority: int = Field(ge=0, le=1000)
    """Lower runs first; a request may name its class by this number."""
    max_waiting: int = Field(default=256, ge=1)
    """Requests admitted but not yet scheduled at most; more get a 429 with Retry-After."""
    max_queued_tokens: int = Field(default=65536, ge=1)
    """Their prompt tokens at most; more get a 429."""
    ttft_target: float = Field(default=2.0, gt=0)
    """Seconds to the first token: a soft target (load shedding, goodput, deadline order)."""
    tpot_target: float = Field(default=0.5, gt=0)
    """Seconds per output token after the first: a soft target (goodput)."""
    queue_timeout: float = Field(default=0.0, ge=0)
    """A request still waiting this long ends with 503 (or a timeout finish in a stream)."""
    ttft_timeout: float = Field(default=0.0, ge=0)
    """No first token this long: the request ends."""
    token_timeout: float = Field(default=0.0, ge=0)
    """A gap this long between two tokens: the request ends."""
    total_timeout: float = Field(default=0.0, ge=0)
    """A request running this long in all ends."""
    max_tokens: int = Field(default=4096, ge=1)
    """A request's max_tokens at most in this class."""
    kv_reserve: float = Field(default=0.0, ge=0, lt=1)
    """The share of KV blocks this class may not use (room for higher classes)."""
    sheddable: bool = False
    """Load shedding may reject, preempt and shorten this class's work."""

    def priority_class(self, name: str) -> PriorityClass:
        def limit(seconds: float) -> float | None:
            return seconds or None

        return PriorityClass(
            name=name, priority=self.priority, max_waiting=self.max_waiting, max_queued_tokens=self.max_queued_tokens,
            ttft_target=self.ttft_target, tpot_target=self.tpot_target,
            timeouts=Timeouts(limit(self.queue_timeout), limit(self.ttft_timeout), limit(self.token_timeout),
                              limit(self.total_timeout)),
            max_tokens=self.max_tokens, kv_reserve=self.kv_reserve, sheddable=self.sheddable,
        )


def _class_table(c: PriorityClass) -> dict[str, Any]:
    """A built-in class as the keys of a [classes.NAME] table."""
    t = c.timeouts
    return {"priority": c.priority, "max_waiting": c.max_waiting, "max_queued_tokens": c.max_queued_tokens,
            "ttft_target": c.ttft_target, "tpot_target": c.tpot_target, "queue_timeout": t.queue or 0.0,
            "ttft_timeout": t.ttft or 0.0, "token_timeout": t.token or 0.0, "total_timeout": t.total or 0.0,
            "max_tokens": c.max_tokens, "kv_reserve": c.kv_reserve, "sheddable": c.sheddable}


BUILTIN_CLASSES = {c.name: _class_table(c) for c in DEFAULT_CLASSES}


class LimitSettings(Section):
    """What one request may ask for."""

    max_tokens_default: int = Field(default=256, ge=1)
    """The max_tokens of a request that names none."""
    max_tokens_limit: int = Field(default=4096, ge=1)
    """A request asking more gets a 400."""
    max_n: int = Field(default=8, ge=1, le=128)
    """Choices per request at most."""
    max_prompts: int = Field(default=64, ge=1)
    """Prompts in one batched /v1/completions request at most."""


class HealthSettings(Section):
    """When the engine counts as unhealthy (/ready, /health)."""

    failure_window_seconds: float = Field(default=30.0, gt=0)
    """A forward failing in two steps in a row, no more than this apart, makes the engine unhealthy."""
    recover_seconds: float = Field(default=10.0, ge=0)
    """Unhealthy: /ready answers 503 at least this long."""
    liveness_failures: int = Field(default=5, ge=2)
    """This many failed steps in a row: /health answers 503."""


class RuntimeSettings(Section):
    """The process."""

    threads: int = Field(default=0, ge=0, le=1024)
    """torch CPU threads; 0: one per core."""
