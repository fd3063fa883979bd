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

from inferd.api.door import FrontDoor
from inferd.api.errors import APIError, bad_request
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
    GrammarError,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from inferd.engine.protocol import LogitsConstraint

MAX_GRAMMAR_CHARS = 64 * 1024  # a larger schema or grammar is refused before it is compiled
# where a request's grammar came from (/metrics counts them; "invalid": it was refused)
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools", "invalid")


def grammar_text(body: SamplingFields) -> tuple[str, str, str] | None:
    """The request's grammar, the field it came from and its kind, or None for free text."""
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
        return tool_call_grammar(specs, name, parallel), "tools", "tools"
    if isinstance(fmt, JSONObjectFormat):
        grammar = json_object_grammar()
    elif isinstance(fmt, JSONSchemaFormat):
        grammar = json_schema_grammar(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict))
    elif isinstance(fmt, RegexFormat):
        grammar = regex_grammar(fmt.regex)
    elif isinstance(fmt, ChoiceFormat):
        grammar = choice_grammar(fmt.choice)
    elif isinstance(fmt, GrammarFormat):
        grammar = lark_grammar(fmt.grammar)
    else:
        return None
    return grammar, "response_format", fmt.type


async def request_constraints(door: FrontDoor, body: SamplingFields, prompts: int) -> list[Any] | None:
    """One fresh constraint per prompt, or None when the request is free text; a 400 naming the
    field for a grammar that does not compile or cannot hold with the other fields."""
    param = "tools" if isinstance(body, ChatCompletionRequest) and body.calls_tools else "response_format"
    try:
        found = grammar_text(body)
        if found is None:
            return None
        grammar, param, kind = found
        if body.ignore_eos:
            raise bad_request(f"ignore_eos cannot be combined with {param}: the grammar ends the answer",
                              param="ignore_eos")
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"the {param} grammar is too large ({len(grammar)} characters; at most "
                              f"{MAX_GRAMMAR_CHARS})", param=param, code="invalid_grammar")
        first: LogitsConstraint = await asyncio.to_thread(door.grammars.compile, grammar)
    except GrammarError as e:
        door.grammar_requests["invalid"] += 1
        raise bad_request(f"the {param} cannot be compiled: {e}", param=param, code="invalid_grammar") from None
    except APIError:
        door.grammar_requests["invalid"] += 1
        raise
    door.grammar_requests[kind] += 1
    return [first] + [first.fork() for _ in range(prompts - 1)]


def check_logit_bias(body: SamplingFields, vocab_size: int) -> None:
    bad = [token for token, _ in body.token_bias if token >= vocab_size]
    if bad:
        raise bad_request(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                          param="logit_bias")
