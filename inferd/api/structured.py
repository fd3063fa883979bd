"""What a request's `response_format` or `tool_choice` compiles to: one grammar per request,
checked and compiled off the event loop, forked for each further prompt (a choice's own copy is
forked by the engine).

    json_object   any JSON object, bounded (inferd/engine/grammar.py says how and why)
    json_schema   the schema; `strict: true` makes a keyword the grammar engine lacks a 400
    regex, choice, grammar (Lark)   extensions, as vLLM offers them
    tool_choice "required" or a named function   only tool calls (inferd/api/tools.py)
"""

from __future__ import annotations

import asyncio
from typing import Any

from inferd.api.errors import bad_request
from inferd.api.chat_protocol import ChatCompletionRequest, NamedToolChoice
from inferd.api.protocol import (
    ChoiceFormat,
    GrammarFormat,
    JSONObjectFormat,
    JSONSchemaFormat,
    RegexFormat,
    SamplingFields,
)
from inferd.api.tools import tool_call_grammar
from inferd.engine.grammar import (
    GrammarCompiler,
    GrammarError,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from inferd.engine.protocol import LogitsConstraint

MAX_GRAMMAR_CHARS = 64 * 1024  # a larger schema or grammar is refused before it is compiled


def grammar_text(body: SamplingFields) -> tuple[str, str] | None:
    """The request's grammar and the field it came from, or None for free text."""
    fmt = body.response_format
    tools = isinstance(body, ChatCompletionRequest) and body.calls_tools
    if tools and fmt is not None and fmt.type != "text":
        raise bad_request("response_format cannot be combined with tools; set tool_choice to \"none\" "
                          "or leave response_format out", param="response_format")
    if tools and body.tool_choice not in (None, "auto"):  # type: ignore[union-attr]
        choice = body.tool_choice  # type: ignore[union-attr]
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        specs = [t.model_dump(exclude_none=True) for t in body.tools or []]  # type: ignore[union-attr]
        parallel = body.parallel_tool_calls is not False  # type: ignore[union-attr]
        return tool_call_grammar(specs, name, parallel), "tools"
    if isinstance(fmt, JSONObjectFormat):
        return json_object_grammar(), "response_format"
    if isinstance(fmt, JSONSchemaFormat):
        return json_schema_grammar(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict)), "response_format"
    if isinstance(fmt, RegexFormat):
        return regex_grammar(fmt.regex), "response_format"
    if isinstance(fmt, ChoiceFormat):
        return choice_grammar(fmt.choice), "response_format"
    if isinstance(fmt, GrammarFormat):
        return lark_grammar(fmt.grammar), "response_format"
    return None


async def request_constraints(compiler: GrammarCompiler, body: SamplingFields, prompts: int) -> list[Any] | None:
    """One fresh constraint per prompt, or None when the request is free text; a 400 naming the
    field for a grammar that does not compile or cannot hold with the other fields."""
    try:
        found = grammar_text(body)
    except GrammarError as e:
        raise bad_request(str(e), param="response_format", code="invalid_grammar") from None
    if found is None:
        return None
    grammar, param = found
    if body.ignore_eos:
        raise bad_request(f"ignore_eos cannot be combined with {param}: the grammar ends the answer", param="ignore_eos")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"the {param} grammar is too large ({len(grammar)} characters; at most "
                          f"{MAX_GRAMMAR_CHARS})", param=param, code="invalid_grammar")
    try:
        first: LogitsConstraint = await asyncio.to_thread(compiler.compile, grammar)
    except GrammarError as e:
        raise bad_request(f"the {param} cannot be compiled: {e}", param=param, code="invalid_grammar") from None
    return [first] + [first.fork() for _ in range(prompts - 1)]


def check_logit_bias(body: SamplingFields, vocab_size: int) -> None:
    bad = [token for token, _ in body.token_bias if token >= vocab_size]
    if bad:
        raise bad_request(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                          param="logit_bias")
