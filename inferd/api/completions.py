"""POST /v1/completions: a prompt (text or token ids) or a batch of them, each its own engine
request; choice index = prompt * n + choice, as OpenAI numbers them. Only what differs from
chat is here; serving.py does the rest."""

from __future__ import annotations

from typing import Any

from inferd.api.errors import bad_request
from inferd.api.logprobs import TokenTexts, completion_logprobs
from inferd.api.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from inferd.api.serving import ChoiceResult, Render, StreamEvents, endpoint
from inferd.api.sse import dumps
from inferd.engine.protocol import EngineOutput
from inferd.model.tokenizer import Tokenizer


class CompletionFormat:
    id_prefix = "cmpl"
    object_name = "text_completion"
    prompt_param = "prompt"
    fit_default = False
    response_model = CompletionResponse

    def prompts(self, tokenizer: Tokenizer, body: CompletionRequest, max_prompts: int) -> list[list[int]]:
        """The token ids of each prompt of the request."""
        prompt = body.prompt
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
        return [tokenizer.encode(p) if isinstance(p, str) else p for p in batch]

    def max_tokens(self, body: CompletionRequest) -> int | None:
        return body.max_tokens

    def logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def prompt_text(self, tokenizer: Tokenizer, body: CompletionRequest, prompts: list[list[int]]) -> str:
        return repr(body.prompt)

    def choice(self, body: CompletionRequest, token_text: TokenTexts, index: int, result: ChoiceResult) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=result.text,
            logprobs=CompletionLogprobs(**completion_logprobs(token_text, result.logprobs, 0))
            if body.logprobs is not None else None,
            finish_reason=result.finish_reason,  # type: ignore[arg-type]
        )

    def head(self, body: CompletionRequest, events: StreamEvents) -> list[dict[str, Any]]:
        return []

    def renderer(self, body: CompletionRequest, token_text: TokenTexts, events: StreamEvents) -> Render:
        offsets: dict[int, int] = {}  # choice -> length of its text so far (logprobs text_offset)

        def render(prompt: int, out: EngineOutput) -> dict[str, Any] | str:
            index = prompt * body.n + out.index
            if body.logprobs is None:
                return events.token_event(index, f'"text":{dumps(out.text)}', out.finish_reason)
            logprobs = completion_logprobs(token_text, out.logprobs or [], offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
            return events.event([{"index": index, "text": out.text, "logprobs": logprobs,
                                  "finish_reason": out.finish_reason}])

        return render


create_completion = endpoint(CompletionRequest, CompletionFormat())
