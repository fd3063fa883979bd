"""Per-request sampling settings: what the API validates and the sampler and detokenizer obey."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max; 0 means off
    presence_penalty: float = 0.0  # OpenAI semantics, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI semantics, in [-2, 2]
    seed: int | None = None  # same seed -> same tokens, alone or inside any batch
    logprobs: int | None = None  # None: none; k in [0, 20]: chosen token's logprob + top k
    # the same for every prompt token after the first (its logprob given the tokens before it),
    # computed in the prefill; such a request's prompt is never served from the prefix cache
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the matched text is not emitted
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or bool(self.logit_bias)
