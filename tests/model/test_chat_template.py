"""Chat templates rendered by us against transformers' apply_chat_template / renderer."""

from __future__ import annotations

import pytest

from inferd.text.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplateError,
    compile_chat_template,
    render_chat_template,
)
from inferd.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Wie geht's? 你好 😀"},
        {"role": "assistant", "content": "Gut, danke.\n\nUnd dir?"},
        {"role": "user", "content": "  spaces  and <tags> & \"quotes\"  "},
    ],
]

# exercises tojson (non-ASCII, HTML characters, indent), loop controls, namespace and tools=None
RICH_TEMPLATE = """{{ bos_token }}
{%- if tools is not none %}TOOLS {{ tools | tojson(indent=2) }}
{% endif %}
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
  {%- if m['role'] == 'skip' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  {{ ns.n }}:{{ m['role'] }}={{ m['content'] | tojson }}{{ eos_token }}
  {%- if ns.n >= 3 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}>{% endif %}"""


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_template_matches_transformers(
    smollm_tokenizer: Tokenizer, hf_smollm_tokenizer, messages: list[dict], add_generation_prompt: bool
) -> None:
    ours = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smollm_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.startswith("<|im_start|>system\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f<ü>", "parameters": {}}}]])
def test_rich_template_matches_transformers(tools: list | None) -> None:
    messages = [{"role": "user", "content": "a<b>&'ü"}, {"role": "skip", "content": "x"}] + CONVERSATIONS[2]
    ours = render_chat_template(RICH_TEMPLATE, messages, bos_token="<s>", eos_token="</s>", tools=tools)
    (theirs,), _ = render_jinja_template(
        conversations=[messages], chat_template=RICH_TEMPLATE, tools=tools,
        add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
    )
    assert ours == theirs
    assert '"a<b>&\'ü"' in ours and "Und dir" not in ours.split("3:")[0] and ours.endswith(">")
    assert ("TOOLS" in ours) == (tools is not None)


def test_raise_exception_is_a_chat_template_error() -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])


def test_bad_templates() -> None:
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat_template("{% for m in messages %}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute games
        render_chat_template("{{ messages.__class__.__mro__ }}", [])


def test_strftime_now_and_cache() -> None:
    out = render_chat_template("{{ strftime_now('%Y') }}", [])
    assert len(out) == 4 and out.isdigit()
    assert compile_chat_template(RICH_TEMPLATE) is compile_chat_template(RICH_TEMPLATE)


def test_default_template_is_chatml(smollm_tokenizer: Tokenizer) -> None:
    messages = CONVERSATIONS[1]
    out = render_chat_template(None, messages)
    assert out == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert out == render_chat_template(DEFAULT_CHAT_TEMPLATE, messages)
    ids = smollm_tokenizer.encode(out)
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> / <|im_end|> are single tokens
