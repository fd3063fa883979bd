"""The grammars that hold tool calls to the declared functions, for every tool_choice that calls.

    "required" / a named function   the answer is only calls (tool_call_grammar)
    "auto"                          free text, but a call the model opens is held to a valid call
                                    of a declared function and then released (auto_call_grammar)

In the Hermes format of tools.py, both end the answer once a call repeats an earlier one
(engine/structured/repeats.py; the parser drops the repeat). How "auto" works, in llguidance's
Lark (docs/syntax.md, "Tool calling"):

    start: call{0,N} FREE                  up to N calls, each after some text, then text
    call: opened body                      body: '{"name": "f", "arguments": ' %json '}</tool_call>'
    opened[lazy]: /(?s:.*)<tool_call>/     any text up to the first opening, and no further
    FREE: any text without the opening     so once the opening is written, only a call goes on

One grammar for the whole answer, compiled at the door like any other: the engine's token masks
(engine/structured/masks.py) need nothing new, and a free-text token costs one mask (~40 µs).

Qwen3.5's XML format (tool_formats.py) has the same two grammars, its calls written as its template
writes them (xml_call_grammar, xml_auto_grammar: the section at the end says what they hold).

Llama-3's format (tool_formats.py) is one call as the whole answer: under "auto" an answer that
starts with "{" is that call, any other is text (llama3_grammar).

A model that speaks harmony (gpt-oss: harmony.py) calls in its commentary channel, one call per
answer, ended by <|call|>; a forced call may follow its reasoning (harmony_call_grammar), and
"auto" runs free (harmony's own parser finds the call):

    start: analysis? call
    analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"
    call: <|channel|> "commentary to=functions.NAME " <|constrain|> "json" <|message|> %json <|call|>
"""

from __future__ import annotations

import json
import re

from inferd.api.admission.ask import Grammar
from inferd.api.conversation.harmony import FUNCTIONS, speaks_harmony
from inferd.api.conversation.render import takes_tools
from inferd.api.conversation.tool_formats import (
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    HERMES,
    LLAMA3_JSON,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    QWEN3_XML,
    tool_format,
    value_types,
)
from inferd.api.conversation.tools import MAX_PARALLEL_CALLS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from inferd.engine.structured.grammar import JSON_LAYOUT
from inferd.text.tokenizer import Tokenizer


def tools_grammar(tokenizer: Tokenizer, tools: list[dict], *, forced: bool, name: str | None, parallel: bool,
                  param: str) -> Grammar | None:
    """The grammar of a request that offers `tools` (OpenAI function dicts): only calls when
    `forced` (to function `name`, or any), else text with well-formed calls (None where the
    model's template has a format not known here). Raises ValueError for a name not among the tools."""
    repeats = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    forced = forced or name is not None
    form = tool_format(tokenizer)
    if not (forced or tools):
        return None
    if speaks_harmony(tokenizer):
        return Grammar(harmony_call_grammar(tools, name), kind="tools", param=param) if forced else None
    if form == LLAMA3_JSON:  # one call, the whole answer: nothing to repeat
        return Grammar(llama3_grammar(tools, name, forced), kind="tools" if forced else "tools_auto", param=param,
                       best_effort=not forced)
    if forced:
        text = xml_call_grammar(tools, name, parallel) if form == QWEN3_XML else tool_call_grammar(tools, name, parallel)
        return Grammar(text, kind="tools", param=param, repeat_tags=repeats)
    if form == QWEN3_XML:
        text = xml_auto_grammar(tools, parallel)
    elif form == HERMES:
        # a template of its own (Qwen's) puts the call on a line of its own: allow its newlines
        text = auto_call_grammar(tools, parallel, newlines=takes_tools(tokenizer))
    else:
        return None
    # NOTE: best effort: tools whose grammar is too large or does not compile leave the answer
    # free, as before, rather than refuse a request that asked for no constraint
    return Grammar(text, kind="tools_auto", param=param, repeat_tags=repeats, ends_answer=False, best_effort=True)


def tool_call_grammar(tools: list[dict], name: str | None, parallel: bool) -> str:
    """An llguidance Lark grammar whose only outputs are tool calls in the prompt's format.

    One call to function `name` (any of `tools` when None); with `parallel`, one to
    MAX_PARALLEL_CALLS calls separated by "\\n". Raises ValueError when `name` is not among `tools`.
    """
    functions = _forced(tools, name)
    lines = [f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "start: call",
             f"call: {json.dumps(TOOL_CALL_OPEN)} body"]
    return "\n".join(lines + _body_rules(functions, newlines=False)) + "\n"


def _forced(tools: list[dict], name: str | None) -> list[dict]:
    """The functions a forced call may call: `name`, or any of `tools`."""
    functions = [tool["function"] for tool in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    if not functions:
        raise ValueError("tool calls are required but no tools were given")
    return functions


def harmony_call_grammar(tools: list[dict], name: str | None) -> str:
    """An llguidance Lark grammar for a harmony model's forced call (the module's docstring): its
    reasoning, if it reasons, then one call to function `name` (any of `tools` when None) with
    arguments valid against its parameters, ended by <|call|> (where the engine stops)."""
    functions = _forced(tools, name)
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = ["%llguidance {}", f"start: analysis? ({calls})",
             'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
             "THOUGHT: /(?s:.*)/"]  # (special tokens are no text: the reasoning cannot hold <|end|>)
    for i, function in enumerate(functions):
        head = json.dumps(f"commentary to={FUNCTIONS}{function['name']} ")
        lines.append(f'call_{i}: <|channel|> {head} <|constrain|> "json" <|message|> args_{i} <|call|>')
        lines.append(f"args_{i}: %json {json.dumps(_schema(function))}")
    return "\n".join(lines) + "\n"


def auto_call_grammar(tools: list[dict], parallel: bool, newlines: bool = False) -> str:
    """An llguidance Lark grammar for an answer under tool_choice "auto": any text, in which each
    `<tool_call>` the model writes must go on as a valid call of one of `tools`, its arguments
    valid against the function's parameters, and closes; at most MAX_PARALLEL_CALLS calls (one
    without `parallel`), after which the opening cannot be written at all."""
    return _auto(_body_rules([t["function"] for t in tools], newlines), parallel)


def _auto(body: list[str], parallel: bool) -> str:
    """The "auto" grammar around the rules of `body`, what follows each <tool_call>."""
    opening = re.escape(TOOL_CALL_OPEN)
    lines = ["%llguidance {}",
             f"start: call{{0,{MAX_PARALLEL_CALLS if parallel else 1}}} FREE",
             f"FREE: /(?s:.*)/ & ~/(?s:.*){opening}(?s:.*)/",  # text in which no call opens
             "call: opened body",
             f"opened[lazy]: /(?s:.*){opening}/"]  # the text before a call, and its opening
    return "\n".join(lines + body) + "\n"


def _body_rules(functions: list[dict], newlines: bool) -> list[str]:
    """`body`: what follows the opening, a call of one of `functions` and the closing."""
    gap = ' "\\n"?' if newlines else ""
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = [f'body:{gap} ({calls}) "}}"{gap} {json.dumps(TOOL_CALL_CLOSE)}']
    for i, function in enumerate(functions):
        head = '{"name": ' + json.dumps(function["name"]) + ', "arguments": '
        lines.append(f"call_{i}: {json.dumps(head)} args_{i}")
        lines.append(f"args_{i}: %json {json.dumps(_schema(function))}")
    return lines


def _schema(function: dict) -> dict:
    """The function's parameters schema, with the JSON layout pinned."""
    return _pinned(function.get("parameters") or {"type": "object"}, function.get("strict"))


def _pinned(schema: dict, strict: bool | None) -> dict:
    """`schema` with the JSON layout pinned."""
    # NOTE: llguidance's %json allows any whitespace by default, and a small model can loop on
    # newlines: the layout is pinned to the prompt's. Not strict: a schema keyword llguidance
    # does not know (e.g. an unusual "format") is dropped instead of failing.
    return {"x-guidance": {**JSON_LAYOUT, "lenient": not strict}, **schema}


def llama3_grammar(tools: list[dict], name: str | None, forced: bool) -> str:
    """Llama-3's format: the answer is one call {"name": ..., "parameters": {...}} of function
    `name` (any of `tools` when None); unless `forced`, an answer whose first non-blank character
    is not "{" is free text instead."""
    functions = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    if not functions:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools" if name else
                         "tool calls are required but no tools were given")
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = ["%llguidance {}", f"start: BLANK ({calls})" if forced else f"start: FREE | BLANK ({calls})",
             r"BLANK: /\s*/", r"FREE: /(?s:\s*([^{\s].*)?)/"]  # text whose first non-blank is not "{"
    for i, function in enumerate(functions):
        head = '{"name": ' + json.dumps(function["name"]) + ', "parameters": '
        lines.append(f'call_{i}: {json.dumps(head)} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(_schema(function))}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Qwen3.5's XML calls (tool_formats.py), as its template writes them:
#
#     <tool_call>\n<function=NAME>\n
#     <parameter=KEY>\nVALUE\n</parameter>\n        one per parameter
#     </function>\n</tool_call>
#
# A string VALUE is raw text without "</parameter>" (an enum's strings are its choices; minLength
# and maxLength bound its characters; other string keywords are not held); a value that cannot be
# a string is %json with the property's schema. The parameters come in the schema's order, each
# required one present and each other one optional (as llguidance's %json orders an object's
# properties), so a call names only declared parameters, each at most once; a function whose
# schema declares no properties (and does not forbid them) may take any names.

_PARAMETER_END = f"\n{PARAMETER_CLOSE}\n"
# NOTE: a text value and its closing are one terminal: llguidance's lexer is greedy, and a bare
# text terminal would run on through "\n</parameter" and fail at the ">"
_NO_CLOSE = "~/(?s:.*)" + re.escape(PARAMETER_CLOSE).replace("/", "\\/") + "(?s:.*)/"


def xml_call_grammar(tools: list[dict], name: str | None, parallel: bool) -> str:
    """An llguidance Lark grammar whose only outputs are XML calls (the format above): one to
    function `name` (any of `tools` when None); with `parallel`, one to MAX_PARALLEL_CALLS calls
    separated by "\\n". Raises ValueError when `name` is not among `tools`."""
    functions = _forced(tools, name)
    lines = ["%llguidance {}",
             f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "start: call",
             f"call: {json.dumps(TOOL_CALL_OPEN)} body"]
    return "\n".join(lines + _xml_body_rules(functions)) + "\n"


def xml_auto_grammar(tools: list[dict], parallel: bool) -> str:
    """auto_call_grammar for the XML format: any text, in which each <tool_call> the model writes
    goes on as a valid XML call of one of `tools` and closes; at most MAX_PARALLEL_CALLS calls
    (one without `parallel`)."""
    return _auto(_xml_body_rules([t["function"] for t in tools]), parallel)


def _xml_body_rules(functions: list[dict]) -> list[str]:
    """`body`: what follows <tool_call>, an XML call of one of `functions` and the closing."""
    calls = " | ".join(f"fn_{i}" for i in range(len(functions)))
    closing = json.dumps(FUNCTION_CLOSE + "\n" + TOOL_CALL_CLOSE)
    lines = [f'body: "\\n" ({calls}) {closing}',
             f"TEXT: (/(?s:.*)/ & {_NO_CLOSE}) {json.dumps(_PARAMETER_END)}"]  # a string value, closed
    any_names = False
    for i, function in enumerate(functions):
        schema = function.get("parameters") or {}
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        params = [f"p_{i}_{j}" + ("" if key in required else "?") for j, key in enumerate(properties)]
        if function.get("parameters") is not None and not properties and schema.get("additionalProperties") is not False:
            params, any_names = ["any_parameter*"], True  # (no parameters at all: none, as OpenAI reads it)
        head = json.dumps(FUNCTION_OPEN + function["name"] + ">\n")
        lines.append(" ".join([f"fn_{i}: {head}", *params]))
        for j, (key, prop) in enumerate(properties.items()):
            head = json.dumps(PARAMETER_OPEN + key + ">\n")
            lines.append(f"p_{i}_{j}: {head} v_{i}_{j}")
            lines += _xml_value(f"v_{i}_{j}", prop, function)
    if any_names:
        lines.append(f'any_parameter: {json.dumps(PARAMETER_OPEN)} /[^<>\\n]+/ ">\\n" TEXT')
    return lines


def _xml_value(rule: str, prop: dict, function: dict) -> list[str]:
    """The rules of `rule`: a parameter's value by its property's schema `prop`, and its closing."""
    types = value_types(prop)
    end = json.dumps(_PARAMETER_END)
    if types and "string" not in types:  # JSON, laid out as the template's tojson writes it
        root = function.get("parameters") or {}
        defs = {key: root[key] for key in ("$defs", "definitions") if key in root}  # for its $refs
        # (the template writes a boolean of the history with Jinja's `string`: True, False)
        python = ' | "True" | "False"' if "boolean" in types else ""
        return [f"{rule}: ({rule}_json{python}) {end}",
                f"{rule}_json: %json {json.dumps(_pinned({**defs, **prop}, function.get('strict')))}"]
    if types != {"string"}:  # no type, or a string among others: any text (the parser reads it)
        return [f"{rule}: TEXT"]
    choices = prop.get("enum")
    if choices and all(isinstance(c, str) and PARAMETER_CLOSE not in c for c in choices):
        return [f"{rule}: ({' | '.join(json.dumps(c) for c in choices)}) {end}"]
    low, high = (prop.get(key) for key in ("minLength", "maxLength"))
    if _count(low) or _count(high):
        bounds = f"{low if _count(low) else 0},{high if _count(high) else ''}"
        return [f"{rule}: {rule.upper()}", f"{rule.upper()}: (/(?s:.){{{bounds}}}/ & {_NO_CLOSE}) {end}"]
    return [f"{rule}: TEXT"]


def _count(value: object) -> bool:
    """Whether a schema's bound is a count (a non-negative integer)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
