"""Chat templates: render a model's Jinja template the way transformers' `apply_chat_template` does.

Same environment (sandboxed, trim_blocks, lstrip_blocks, loopcontrols), the same `tojson`,
`raise_exception` and `strftime_now`, and the same variables: messages, add_generation_prompt,
bos_token, eos_token, tools, documents, plus whatever the caller passes.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# NOTE: used for a model whose files carry no template: plain ChatML, which most small
# instruction-tuned models (SmolLM, Qwen) were trained on. It is a guess, not the model's own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A template that fails to compile or render, or that calls raise_exception (the message says why)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: Jinja's own tojson escapes HTML characters (<, >, &, '), which templates do not expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text (a server has one or two)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def render_chat_template(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text for `messages`; `template` None means DEFAULT_CHAT_TEMPLATE (ChatML)."""
    compiled = compile_chat_template(template if template is not None else DEFAULT_CHAT_TEMPLATE)
    # NOTE: tools / documents are passed as None, not left undefined, as transformers does:
    # templates test `tools is not none`, which is true for an undefined name.
    kwargs.setdefault("tools", None)
    kwargs.setdefault("documents", None)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **kwargs,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
