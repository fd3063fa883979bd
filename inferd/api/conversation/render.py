"""Messages and tools as the model's prompt, through its chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from inferd.api.conversation import harmony
from inferd.api.conversation.tools import history_message, tools_system_prompt
from inferd.api.errors import bad_request
from inferd.text.chat_template import ChatTemplateError
from inferd.text.tokenizer import Tokenizer


def takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the model's template renders `tools` (and earlier calls) itself, as transformers passes them."""
    return "tools" in (tokenizer.chat_template or "")


def render_prompt(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                  add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
                  param: str = "messages", effort: str | None = None) -> list[int]:
    """The messages (template dicts: role, content, tool_calls with mapping arguments,
    tool_call_id) and the tools offered (OpenAI function dicts) as token ids. A template that takes
    `tools` renders them and earlier calls itself; for one that does not (the default model's),
    they become plain text in the Hermes format of tools.py. A template that fails on the
    client's messages is a 400 naming `param`. A model that speaks harmony (gpt-oss) is rendered
    by openai_harmony instead (harmony.py), with the reasoning `effort` ("low", "medium", "high")."""
    if harmony.speaks_harmony(tokenizer):
        try:
            effort = effort or (template_kwargs or {}).get("reasoning_effort")  # (gpt-oss's template's name)
            return harmony.render(messages, tools, effort, add_generation_prompt)
        except harmony.HarmonyError as e:
            raise bad_request(f"these messages cannot be written in harmony: {e}", param=param) from None
    native = takes_tools(tokenizer)
    rendered = [dict(m) if native or not _has_tool_parts(m) else history_message(m) for m in messages]
    if tools and not native:
        instructions = tools_system_prompt(list(tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = instructions + "\n\n" + rendered[0]["content"]
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                             tools=list(tools) if tools and native else None,
                                             **(template_kwargs or {}))
    except ChatTemplateError as e:
        raise bad_request(str(e), param=param) from None
    except Exception as e:  # noqa: BLE001 - the template ran on client input: a TypeError there is a 400
        raise bad_request(f"chat template failed on these messages: {e}", param=param) from None
    # the template writes BOS itself where the model wants one
    return tokenizer.encode(text, add_special_tokens=False)


def _has_tool_parts(message: dict[str, Any]) -> bool:
    return bool(message.get("tool_calls")) or message.get("role") == "tool"



def call_arguments(text: str) -> Any:
    """A tool call's arguments (JSON text on the wire) as templates index them: a mapping
    (transformers' convention), or the text as sent when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text
