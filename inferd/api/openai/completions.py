"""POST /v1/completions: a prompt (text or token ids) or a batch of them, each its own engine
request; choice index = prompt * n + choice, as OpenAI numbers them. Its answer as a
text_completion, whole or streamed; the shared path (api/pipeline/) does the rest."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from inferd.api.admission.ask import Shaped, build_grammar
from inferd.api.body import read_json
from inferd.api.errors import bad_request
from inferd.api.openai.ask import to_ask
from inferd.api.openai.events import StreamEvents, with_usage
from inferd.api.openai.logprobs import TokenTexts, completion_logprobs, echo_logprobs, token_texts
from inferd.api.openai.structured import request_grammar
from inferd.api.openai.wire import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from inferd.api.pipeline.generate import generate
from inferd.api.pipeline.sessions import asked_session
from inferd.api.pipeline.shape import Events, Reply
from inferd.api.streaming.generation import ChoiceResult, Render
from inferd.api.streaming.sse import dumps
from inferd.engine.protocol import EngineOutput
from inferd.text.tokenizer import Tokenizer


class CompletionShape:
    """One completions request's prompts and answer (pipeline/shape.py's Shape)."""

    id_prefix = "cmpl"

    def __init__(self, body: CompletionRequest) -> None:
        self.body = body
        self.prompt_ids: list[list[int]] = []  # (echo) each prompt's tokens, as prepare() made them

    def prepare(self, tokenizer: Tokenizer, max_prompts: int) -> Shaped:
        """The token ids of each prompt of the request, and the grammar its answers are held to."""
        prompt = self.body.prompt
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
        self.prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in batch]
        return Shaped(self.prompt_ids, build_grammar(lambda: request_grammar(self.body, tokenizer)))

    def prompt_text(self, tokenizer: Tokenizer, prompts: list[list[int]]) -> str:
        return repr(self.body.prompt)

    def whole(self, reply: Reply, results: dict[int, ChoiceResult]) -> dict[str, Any]:
        token_text = token_texts(reply.tokenizer)
        choices = [self._choice(reply.tokenizer, token_text, index, result, results)
                   for index, result in sorted(results.items())]
        return CompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                                  usage=Usage(**self._usage(reply))).model_dump(mode="json")

    def _choice(self, tokenizer: Tokenizer, token_text: TokenTexts, index: int, result: ChoiceResult,
                results: dict[int, ChoiceResult]) -> CompletionChoice:
        body = self.body
        text, logprobs = result.text, result.logprobs
        if body.max_tokens == 0:  # the prompt alone (the engine sampled one token, not shown)
            text, logprobs = "", []
        prompt = index // body.n
        echo = self._echo_text(tokenizer, prompt) if body.echo else ""
        shown = None
        if body.logprobs is not None:
            shown = completion_logprobs(token_text, logprobs, len(echo))
            if body.echo:  # the prompt's entries first (they come with its choice 0)
                scored = echo_logprobs(token_text, self.prompt_ids[prompt], results[prompt * body.n].prompt_logprobs or [])
                shown = {key: scored[key] + shown[key] for key in shown}
        return CompletionChoice(
            index=index,
            text=echo + text,
            logprobs=CompletionLogprobs(**shown) if shown is not None else None,
            finish_reason=result.finish_reason,  # type: ignore[arg-type]
        )

    def _echo_text(self, tokenizer: Tokenizer, prompt: int) -> str:
        """The prompt as echoed: as sent when it was text, else its tokens decoded."""
        sent = self.body.prompt
        if isinstance(sent, str):
            return sent
        if sent and isinstance(sent[0], str):
            return sent[prompt]  # type: ignore[return-value]
        return tokenizer.decode(self.prompt_ids[prompt], skip_special_tokens=False)

    def _usage(self, reply: Reply) -> dict[str, Any]:
        usage = reply.usage()
        if self.body.max_tokens == 0:  # (its one sampled token is not shown, nor counted)
            usage |= {"completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
        return usage

    def stream(self, reply: Reply) -> Events:
        body = self.body
        events = StreamEvents("text_completion", reply.id, reply.created, reply.model)

        def tail() -> list[dict[str, Any]]:
            return [events.event([], reply.usage())] if body.include_usage else []

        render = self._renderer(token_texts(reply.tokenizer), events)
        return Events([], with_usage(render, reply.usage) if body.continuous_usage else render, tail)

    def _renderer(self, token_text: TokenTexts, events: StreamEvents) -> Render:
        body = self.body
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


async def create_completion(request: web.Request) -> web.StreamResponse:
    body = CompletionRequest.model_validate(await read_json(request))
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 (0, the prompt's logprobs alone, needs echo)",
                          param="max_tokens")
    if body.echo and body.stream:
        raise bad_request("echo is answered whole: set stream to false", param="echo")
    ask = to_ask(body, max_tokens=1 if body.max_tokens == 0 else body.max_tokens, logprobs=body.logprobs,
                 fit_default=False, prompt_param="prompt", session=asked_session(request))
    if body.echo and body.logprobs is not None:  # the prompt's own logprobs, from its prefill
        ask = dataclasses.replace(ask, sampling=dataclasses.replace(ask.sampling, prompt_logprobs=body.logprobs))
    return await generate(request, ask, CompletionShape(body))
