"""POST /v1/completions: a prompt (text or token ids) or a batch of them, each its own engine
request; choice index = prompt * n + choice, as OpenAI numbers them."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from inferd.api.errors import bad_request
from inferd.api.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from inferd.api.serving import (
    StreamEvents,
    ENGINE,
    SETTINGS,
    TOKEN_TEXTS,
    Generation,
    check_model,
    check_n,
    completion_logprobs,
    no_answer,
    priority_class,
    read_json,
    request_record,
    request_timeouts,
    resolve_max_tokens,
    sampling_params,
)
from inferd.api.sse import dumps
from inferd.engine.engine import AsyncEngine
from inferd.engine.llm_engine import RequestOutput


def prompt_ids(engine: AsyncEngine, prompt: str | list[str] | list[int] | list[list[int]], max_prompts: int) -> list[list[int]]:
    """The token ids of each prompt of the request."""
    if isinstance(prompt, str):
        batch: list[str] | list[list[int]] = [prompt]
    elif not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    elif isinstance(prompt[0], int):
        batch = [prompt]  # type: ignore[list-item]
    else:
        batch = prompt  # type: ignore[assignment]
    if len(batch) > max_prompts:
        raise bad_request(f"at most {max_prompts} prompts per request, got {len(batch)}", param="prompt")
    return [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in batch]


async def create_completion(request: web.Request) -> web.StreamResponse:
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    body = CompletionRequest.model_validate(await read_json(request))
    check_model(engine, body.model)
    check_n(settings, body.n)
    cls = priority_class(engine, body)
    prompts = prompt_ids(engine, body.prompt, settings.limits.max_prompts)
    max_tokens = [
        resolve_max_tokens(body.max_tokens, len(p), engine.max_model_len, settings, fit_default=False,
                           prompt_param="prompt", cls=cls)
        for p in prompts
    ]
    # NOTE: explicit or default, max_tokens is the same for every prompt once it fits them all
    params = sampling_params(body, max_tokens[0], body.logprobs)
    token_text = request.app[TOKEN_TEXTS]
    record = request_record(request, body.user, lambda: repr(body.prompt))
    with Generation(engine, prompts, params, body.n, cls, request_timeouts(body), "cmpl", record) as gen:
        completion_id = gen.id
        if not body.stream:
            results = await gen.gather(request)
            if results is None:
                return no_answer()
            choices = [
                CompletionChoice(
                    index=index,
                    text=result.text,
                    logprobs=CompletionLogprobs(**completion_logprobs(token_text, result.logprobs, 0))
                    if body.logprobs is not None else None,
                    finish_reason=result.finish_reason,  # type: ignore[arg-type]
                )
                for index, result in sorted(results.items())
            ]
            response = CompletionResponse(id=completion_id, created=gen.created, model=engine.model_name,
                                          choices=choices, usage=Usage(**gen.usage()))
            return web.json_response(response.model_dump(mode="json"))

        offsets: dict[int, int] = {}  # choice -> length of its text so far (logprobs text_offset)

        events = StreamEvents("text_completion", completion_id, gen.created, engine.model_name)
        event, fast_head = events.event, events.token_head  # per-token events: only text and finish vary

        def render(prompt: int, out: RequestOutput) -> dict[str, Any] | str:
            index = prompt * body.n + out.index
            if body.logprobs is None:
                return (f'{fast_head}{index},"text":{dumps(out.text)},"logprobs":null,'
                        f'"finish_reason":{dumps(out.finish_reason)}}}]}}')
            logprobs = completion_logprobs(token_text, out.logprobs or [], offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
            return event([{"index": index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}])

        def tail() -> list[dict[str, Any]]:
            return [event([], gen.usage())] if body.include_usage else []

        return await gen.stream(request, [], render, tail)
