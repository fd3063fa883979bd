"""Volatile prompt blocks: system or message text that changes on every request and would end
the prefix cache's match where it stands (Claude Code's first system block, its billing header
`x-anthropic-billing-header: cc_version=...; cch=...;`). Each protocol drops the blocks that
match one of `cache.volatile_prompt_patterns` before the chat template renders the prompt.

NOTE: this changes the model's input (the block is never seen); `volatile_prompt_patterns = []`
turns it off. A block is a whole content block, or a whole content (a system string, a message
string) when it is plain text; a matching string becomes "" (its message stays: roles alternate).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from aiohttp import web

from inferd.settings.values import SettingsError

C = TypeVar("C", bound="str | list[Any] | None")  # a content: plain text, a list of blocks, or none


def compile_patterns(patterns: Sequence[str]) -> tuple[re.Pattern[str], ...]:
    """The patterns compiled once; a SettingsError naming the key and the pattern for a bad one."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise SettingsError(f"cache.volatile_prompt_patterns: {pattern!r} is not a regular expression "
                                f"({e})") from None
    return tuple(compiled)


class VolatileBlocks:
    """The compiled patterns (re.search: anywhere unless anchored), and the blocks they dropped."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = compile_patterns(patterns)
        self.dropped = 0  # every generation request's, since start (inferd_prompt_volatile_blocks_total)

    def matches(self, text: str) -> bool:
        return any(p.search(text) for p in self.patterns)

    def strip(self, content: C, text: Callable[[Any], str | None]) -> tuple[C, int]:
        """`content` less its volatile text, and how many blocks that dropped: a plain string
        that matches becomes "", a block whose `text(block)` matches is left out (`text` gives
        None for a block that is not text: it is kept)."""
        if not self.patterns or content is None:
            return content, 0
        if isinstance(content, str):
            return (cast(C, ""), 1) if self.matches(content) else (content, 0)
        kept = [block for block in content if (t := text(block)) is None or not self.matches(t)]
        return cast(C, kept), len(content) - len(kept)


VOLATILE = web.AppKey("volatile_blocks", VolatileBlocks)
