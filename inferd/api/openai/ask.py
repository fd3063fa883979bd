"""An OpenAI request body (chat or completions) as the shared path's `Ask`."""

from __future__ import annotations

from inferd.api.admission.ask import Ask, Sampling, SessionAsk
from inferd.api.openai.wire import SamplingFields
from inferd.settings.policy import Timeouts


def to_ask(body: SamplingFields, *, max_tokens: int | None, logprobs: int | None, fit_default: bool,
           prompt_param: str, session: SessionAsk | None = None, volatile_blocks: int = 0) -> Ask:
    """What the body asks for, in the engine's terms; the door checks every limit of it."""
    sampling = Sampling(
        temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0), min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, seed=body.seed,
        stop=body.stop_strings, ignore_eos=body.ignore_eos, logit_bias=body.token_bias,
    )
    timeouts = Timeouts(queue=body.queue_timeout, ttft=body.ttft_timeout, token=body.token_timeout,
                        total=body.total_timeout)
    return Ask(model=body.model, n=body.n, stream=body.stream, priority=body.priority, user=body.user,
               max_tokens=max_tokens, fit_default=fit_default, logprobs=logprobs, sampling=sampling,
               timeouts=timeouts, segment=body.segment, resumable=body.resumable, cache_salt=body.cache_salt,
               prompt_param=prompt_param, session=session, volatile_blocks=volatile_blocks)
