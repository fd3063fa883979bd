"""Batch invariance in the default configuration, on a real `inferd serve` (bfloat16, packed
weights, [model] deterministic on, speculation auto): concurrent greedy streams (64 in the soak
tier, 6 in the default one) each give the tokens the same request gives alone; and speculative
decoding keeps them: concurrent streams that copy their prompts (64 in the soak tier, 6 in the
default one) give the same text with speculation as with `--speculative off`, the drafts showing
in each response's usage (inferd's `speculative` extension) and in /metrics. The default tier
runs both checks on one default server (and one with speculation off). Driven by the official
openai client."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import openai
import pytest
from serveproc import start_server, stop_server

pytestmark = pytest.mark.served  # it starts a real server

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly vexing brains".split()
MODEL = "smollm2"


def prompt(i: int) -> str:
    return f"Story {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(4 + (i * 37) % 90))


async def stream(client: openai.AsyncOpenAI, text: str) -> str:
    chunks = await client.completions.create(model=MODEL, prompt=text, max_tokens=16, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    return "".join([c.choices[0].text async for c in chunks])


async def together_and_alone(url: str, streams: int) -> tuple[list[str], list[str]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [prompt(i) for i in range(streams)]
    together = await asyncio.gather(*(stream(client, p) for p in prompts))
    alone = [await stream(client, p) for p in prompts]
    await client.close()
    return together, alone


@pytest.mark.soak
@pytest.mark.parametrize("streams", [64])
def test_concurrent_greedy_streams_each_equal_the_request_alone(tmp_path: Path, streams: int) -> None:
    server = start_server(tmp_path, "--served-model-name", MODEL)  # no inferd.toml in its folder: defaults
    try:
        together, alone = asyncio.run(together_and_alone(server.url, streams))
    finally:
        stop_server(server)
    assert all(together), together
    differ = [i for i in range(streams) if together[i] != alone[i]]
    assert not differ, [(i, together[i], alone[i]) for i in differ]


SENTENCES = ["The river ran cold and clear under the old stone bridge.",
             "A fox crossed the field at dawn, looking for the hens.",
             "The baker sold warm bread to the sailors before the tide turned.",
             "Seven wizards argued all night about the colour of the moon.",
             "In the library a clock ticked louder than anyone spoke."]


def copy_prompt(i: int) -> str:
    """A passage given twice, then asked for again (every other one), or a plain question."""
    passage = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(2 + i % 3))
    if i % 2:
        return f"Question {i}: name a colour and a fruit."
    return f"Passage: {passage}\nThe same passage again: {passage}\nAnd once more, word for word:"


async def complete(client: openai.AsyncOpenAI, i: int) -> tuple[str, dict]:
    extra = {"ignore_eos": True} if i % 3 == 0 else {}
    if i % 4 == 1:  # a seeded, sampled one among them
        kwargs = {"temperature": 0.8, "seed": i}
    else:
        kwargs = {"temperature": 0}
    chunks = await client.completions.create(model=MODEL, prompt=copy_prompt(i), max_tokens=32, stream=True,
                                             stream_options={"include_usage": True}, extra_body=extra, **kwargs)
    text, usage = "", {}
    async for c in chunks:
        if c.choices:
            text += c.choices[0].text
        if c.usage is not None:
            usage = c.usage.model_dump()
    return text, usage


async def all_at_once(url: str, streams: int) -> list[tuple[str, dict]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        return await asyncio.gather(*(complete(client, i) for i in range(streams)))
    finally:
        await client.close()


def counter(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    assert match, name
    return float(match.group(1))


@pytest.mark.parametrize(("streams", "methods"), [pytest.param(64, ("off", "suffix"), marks=pytest.mark.soak),
                                                  (6, ("off", None))])
def test_concurrent_streams_are_the_same_with_and_without_speculation(tmp_path: Path, streams: int,
                                                                      methods: tuple[str, str | None]) -> None:
    """methods: the server without speculation, then the one with (None: the default, auto; the
    default tier's, which also checks batch invariance, the soak tier's test above)."""
    answers, off_method, on_method = {}, *methods
    for method in methods:
        folder = tmp_path / str(method)
        folder.mkdir()
        server = start_server(folder, "--served-model-name", MODEL, *(("--speculative", method) if method else ()))
        try:
            answers[method] = asyncio.run(all_at_once(server.url, streams))
            accepted = counter(server.url, "inferd_spec_accepted_tokens")
            if method is None:  # (the default server: batch invariance too)
                together, alone = asyncio.run(together_and_alone(server.url, streams))
        finally:
            stop_server(server)
        if method != "off":
            assert accepted > 0
    if on_method is None:
        assert together == alone and all(together)
    off, on = answers[off_method], answers[on_method]
    differ = [i for i in range(streams) if off[i][0] != on[i][0]]
    assert not differ, [(i, off[i][0], on[i][0]) for i in differ]
    assert sum(1 for text, _ in off if len(text) > 30) >= streams // 2
    assert all("speculative" not in usage or usage["speculative"] is None for _, usage in off)
    drafted = [usage["speculative"] for _, usage in on if usage.get("speculative")]
    assert drafted and sum(d["accepted_tokens"] for d in drafted) > 0
    assert all(0 <= d["accepted_tokens"] <= d["drafted_tokens"] for d in drafted)
    assert [u["completion_tokens"] for _, u in off] == [u["completion_tokens"] for _, u in on]
