"""How chat messages, tools, earlier calls and tool results become a prompt: through the chat
template when it takes `tools` (transformers' convention), else as the Hermes-format text that
inferd/api/conversation/tools.py documents."""

from __future__ import annotations

import copy

import pytest

from inferd.api.openai.chat import chat_prompt
from inferd.api.openai.chat_wire import ChatMessage, Tool
from inferd.model.loading.loader import default_model_path
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer

# a template that takes tools, reads calls' arguments as a mapping, and knows the tool role
NATIVE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
          "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
          "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
          "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{% endfor %}")
WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}})
HISTORY = [ChatMessage.model_validate(m) for m in [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
]]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def text(tokenizer: Tokenizer, tools: list[Tool] | None) -> str:
    return tokenizer.decode(chat_prompt(tokenizer, HISTORY, tools), skip_special_tokens=False)


def test_a_template_that_takes_tools_renders_them_and_the_calls_itself(tokenizer: Tokenizer) -> None:
    native = copy.copy(tokenizer)
    native.chat_template = NATIVE
    rendered = text(native, [WEATHER])
    assert rendered.startswith("<tools>get_weather;</tools>[system]Be brief.[user]Weather in Paris?")
    assert "[assistant]CALL get_weather(Paris)[tool]21C for call_1" in rendered
    assert "<tool_call>" not in rendered and "You can call functions" not in rendered


def test_the_default_template_gets_the_tools_as_a_system_message_and_hermes_text(tokenizer: Tokenizer) -> None:
    rendered = text(tokenizer, [WEATHER])
    system = rendered.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou can call functions") and system.endswith("Be brief.")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert "<|im_start|>tool\n<tool_response>\n21C\n</tool_response>" in rendered
    assert "You can call functions" not in text(tokenizer, None)  # no tools offered, none described
