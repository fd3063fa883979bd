"""What an OpenAI request's `response_format` or `tool_choice` asks for: the grammar text the
model's door compiles (off the event loop, admission/door.py), once per request, forked for
each further prompt (a choice's own copy is forked by the engine).

    json_object   any JSON object, bounded (inferd/engine/structured/grammar.py says how and why)
    json_schema   the schema; `strict: true` makes a keyword the grammar engine lacks a 400
    regex, choice, grammar (Lark)   extensions, as vLLM offers them
    tools         "required" or a named function: only tool calls; "auto": text, and any call it
                  opens held to a valid call (inferd/api/conversation/tool_grammar.py)
"""

from __future__ import annotations

from inferd.api.admission.ask import Grammar
from inferd.api.errors import bad_request
from inferd.api.openai.chat_wire import ChatCompletionRequest, NamedToolChoice
from inferd.api.openai.wire import (
    ChoiceFormat,
    GrammarFormat,
    JSONObjectFormat,
    JSONSchemaFormat,
    RegexFormat,
    SamplingFields,
)
from inferd.api.conversation.tool_grammar import tools_grammar
from inferd.engine.structured.grammar import (
    GrammarError,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from inferd.text.tokenizer import Tokenizer


def grammar_text(body: SamplingFields, tokenizer: Tokenizer) -> Grammar | None:
    """The request's grammar, its kind and the field it came from, or None for free text."""
    fmt = body.response_format
    tools = isinstance(body, ChatCompletionRequest) and body.calls_tools
    if tools and fmt is not None and fmt.type != "text":
        raise bad_request("response_format cannot be combined with tools; set tool_choice to \"none\" "
                          "or leave response_format out", param="response_format")
    if tools:
        choice = body.tool_choice  # type: ignore[union-attr]
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        specs = [t.model_dump(exclude_none=True) for t in body.tools or []]  # type: ignore[union-attr]
        parallel = body.parallel_tool_calls is not False  # type: ignore[union-attr]
        return tools_grammar(tokenizer, specs, forced=choice not in (None, "auto"), name=name, parallel=parallel,
                             param="tools")
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
    return Grammar(grammar, kind=fmt.type, param="response_format")


def request_grammar(body: SamplingFields, tokenizer: Tokenizer) -> Grammar | None:
    """The request's grammar, or None for free text; a 400 naming the field for one that cannot
    be built or cannot hold with the other fields (the door counts it as invalid)."""
    param = "tools" if isinstance(body, ChatCompletionRequest) and body.calls_tools else "response_format"
    try:
        return grammar_text(body, tokenizer)
    except GrammarError as e:
        raise bad_request(f"the {param} cannot be compiled: {e}", param=param, code="invalid_grammar") from None
