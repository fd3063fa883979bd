"""A thinking model's constraints: a grammar that holds the content, not the reasoning, and a
budget that ends the reasoning.

    the prompt opened the block:   start: think NL content
    the answer may open it:        start: (OPEN NL think NL)? content
    think[lazy]: /(?s:.*)<\\/think>/   any reasoning, up to its closing marker, and no further
    NL: /\\n{0,2}/                      the newlines a template writes after a marker
    content: @answer                   the request's own grammar (json_schema, tools, Lark...)

The request's grammar goes in whole as a subgrammar (llguidance's `@name`), so it binds the
content exactly as it binds a non-thinking model's answer; a non-thinking model's grammar is
left as it is. The budget is the engine's (engine/structured/budget.py says why not llguidance's
`max_tokens`): the door wraps the grammar's constraint, or none, in it.
"""

from __future__ import annotations

import dataclasses
import json
import re

from inferd.api.admission.ask import Grammar, Thinking
from inferd.api.conversation.reasoning import PromptReasoning
from inferd.text.tokenizer import Tokenizer

# the Responses API's reasoning.effort as thinking budgets (tokens of reasoning; None: unbounded)
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 128, "low": 512, "medium": 2048, "high": 8192, "xhigh": None}


def thinking(reasoning: PromptReasoning | None, budget: int | None) -> Thinking | None:
    """The budget of a thinking model's request (None: none asked, or a model that does not think)."""
    if reasoning is None or budget is None:
        return None
    markers, inside = reasoning.markers, reasoning.inside
    # NOTE: forced as thinking templates write it ("\n</think>\n\n"): after the bare marker the
    # default model ends its answer at once, after the newlines it answers
    return Thinking(markers.open, markers.close, inside, budget, closing=f"\n{markers.close}\n\n")


def after_reasoning(grammar: Grammar | None, tokenizer: Tokenizer, reasoning: PromptReasoning | None) -> Grammar | None:
    """`grammar` for the content that follows a thinking model's reasoning (the module's
    docstring); unchanged for a model that does not think."""
    if grammar is None or reasoning is None:
        return grammar
    markers, inside = reasoning.markers, reasoning.inside
    text = grammar.text
    top = json.loads(text) if text.lstrip().startswith("{") else {"grammars": [{"lark_grammar": text}]}
    inner = top["grammars"]
    name = inner[0].get("name") or "answer"
    inner[0]["name"] = name
    opening, thought = _literal(tokenizer, markers.open), _thought(tokenizer, markers.close)
    lark = "\n".join(["%llguidance {}",
                      "start: think NL content" if inside else f"start: ({opening} NL think NL)? content",
                      thought, r"NL: /\n{0,2}/", f"content: @{name}"])
    return dataclasses.replace(grammar, text=json.dumps({"grammars": [{"lark_grammar": lark}, *inner]}))


def _special(tokenizer: Tokenizer, marker: str) -> bool:
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return len(ids) == 1 and ids[0] in tokenizer.special_ids


def _literal(tokenizer: Tokenizer, marker: str) -> str:
    """A marker in Lark: a special token by its name, or text."""
    return marker if _special(tokenizer, marker) else json.dumps(marker)


def _thought(tokenizer: Tokenizer, close: str) -> str:
    """`think`: the reasoning and its closing marker."""
    if _special(tokenizer, close):  # (a special token is no text: the reasoning's text cannot hold it)
        return f"think: THOUGHT {close}\nTHOUGHT: /(?s:.*)/"
    return f"think[lazy]: /(?s:.*){_regex(close)}/"


def _regex(text: str) -> str:
    """`text` inside a Lark /regex/ (its slashes escaped too)."""
    return re.escape(text).replace("/", "\\/")
