"""POST /v1/chat/completions: messages rendered with the model's chat template, then one engine
request with n choices. Only what differs from completions is here; serving.py does the rest."""

from __future__ import annotations

from typing import Any

from inferd.api.errors import bad_request
from inferd.api.logprobs import TokenTexts, chat_logprobs
from inferd.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
)
from inferd.api.serving import ChoiceResult, Render, StreamEvents, endpoint
from inferd.api.sse import dumps
from inferd.engine.protocol import EngineOutput
from inferd.model.chat_template import ChatTemplateError
from inferd.model.tokenizer import Tokenizer


class ChatFormat:
    id_prefix = "chatcmpl"
    object_name = "chat.completion.chunk"
    prompt_param = "messages"
    fit_default = True
    response_model = ChatCompletionResponse

    def prompts(self, tokenizer: Tokenizer, body: ChatCompletionRequest, max_prompts: int) -> list[list[int]]:
        messages = []
        for message in body.messages:
            rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
            if message.name is not None:
                rendered["name"] = message.name
            messages.append(rendered)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - the template ran on client input: a TypeError there is a 400
            raise bad_request(f"chat template failed on these messages: {e}", param="messages") from None
        # the template writes BOS itself where the model wants one
        return [tokenizer.encode(text, add_special_tokens=False)]

    def max_tokens(self, body: ChatCompletionRequest) -> int | None:
        return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    def logprobs(self, body: ChatCompletionRequest) -> int | None:
        return (body.top_logprobs or 0) if body.logprobs else None

    def prompt_text(self, tokenizer: Tokenizer, body: ChatCompletionRequest, prompts: list[list[int]]) -> str:
        return tokenizer.decode(prompts[0])

    def choice(self, body: ChatCompletionRequest, token_text: TokenTexts, index: int, result: ChoiceResult) -> ChatChoice:
        return ChatChoice(
            index=index,
            message=ChatResponseMessage(content=result.text),
            logprobs=ChatLogprobs(**chat_logprobs(token_text, result.logprobs)) if body.logprobs else None,
            finish_reason=result.finish_reason,  # type: ignore[arg-type]
        )

    def head(self, body: ChatCompletionRequest, events: StreamEvents) -> list[dict[str, Any]]:
        return [events.event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}]) for i in range(body.n)]

    def renderer(self, body: ChatCompletionRequest, token_text: TokenTexts, events: StreamEvents) -> Render:
        def render(prompt: int, out: EngineOutput) -> dict[str, Any] | str:
            delta = {"content": out.text} if out.text or not out.finished else {}
            if not body.logprobs:
                return events.token_event(out.index, f'"delta":{dumps(delta)}', out.finish_reason)
            logprobs = chat_logprobs(token_text, out.logprobs or [])
            return events.event([{"index": out.index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": out.finish_reason}])

        return render


create_chat_completion = endpoint(ChatCompletionRequest, ChatFormat())
