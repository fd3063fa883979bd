"""POST /v1/chat/completions: messages rendered with the model's chat template, then one engine
request with n choices."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from inferd.api.errors import bad_request
from inferd.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    Usage,
)
from inferd.api.serving import (
    StreamEvents,
    ENGINE,
    SETTINGS,
    TOKEN_TEXTS,
    Generation,
    chat_logprobs,
    check_model,
    check_n,
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
from inferd.model.chat_template import ChatTemplateError


def render_messages(engine: AsyncEngine, body: ChatCompletionRequest) -> list[int]:
    messages = []
    for message in body.messages:
        rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            rendered["name"] = message.name
        messages.append(rendered)
    try:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - the template ran on client input: a TypeError there is a 400
        raise bad_request(f"chat template failed on these messages: {e}", param="messages") from None
    # the template writes BOS itself where the model wants one
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    body = ChatCompletionRequest.model_validate(await read_json(request))
    check_model(engine, body.model)
    check_n(settings, body.n)
    cls = priority_class(engine, body)
    prompt = render_messages(engine, body)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt), engine.max_model_len, settings,
                                    fit_default=True, prompt_param="messages", cls=cls)
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    token_text = request.app[TOKEN_TEXTS]
    record = request_record(request, body.user, lambda: engine.tokenizer.decode(prompt))
    with Generation(engine, [prompt], params, body.n, cls, request_timeouts(body), "chatcmpl", record) as gen:
        completion_id = gen.id
        if not body.stream:
            results = await gen.gather(request)
            if results is None:
                return no_answer()
            choices = [
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(content=result.text),
                    logprobs=ChatLogprobs(**chat_logprobs(token_text, result.logprobs)) if body.logprobs else None,
                    finish_reason=result.finish_reason,  # type: ignore[arg-type]
                )
                for index, result in sorted(results.items())
            ]
            response = ChatCompletionResponse(id=completion_id, created=gen.created, model=engine.model_name,
                                              choices=choices, usage=Usage(**gen.usage()))
            return web.json_response(response.model_dump(mode="json"))

        events = StreamEvents("chat.completion.chunk", completion_id, gen.created, engine.model_name)
        event, fast_head = events.event, events.token_head  # per-token events: only the delta and finish vary

        def render(prompt: int, out: RequestOutput) -> dict[str, Any] | str:
            delta = {"content": out.text} if out.text or not out.finished else {}
            if not body.logprobs:
                return (f'{fast_head}{out.index},"delta":{dumps(delta)},"logprobs":null,'
                        f'"finish_reason":{dumps(out.finish_reason)}}}]}}')
            logprobs = chat_logprobs(token_text, out.logprobs or [])
            return event([{"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason}])

        head = [
            event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            for i in range(body.n)
        ]

        def tail() -> list[dict[str, Any]]:
            return [event([], gen.usage())] if body.include_usage else []

        return await gen.stream(request, head, render, tail)
