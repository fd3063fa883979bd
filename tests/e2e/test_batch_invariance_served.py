"""Batch invariance in the default configuration, on a real `inferd serve` (bfloat16, packed
weights, [model] deterministic on): concurrent greedy streams (64 in the soak tier, 12 in the
default one) each give the tokens the same request gives alone. Driven by the official openai
client."""

from __future__ import annotations

import asyncio
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


@pytest.mark.parametrize("streams", [pytest.param(64, marks=pytest.mark.soak), 6])
def test_concurrent_greedy_streams_each_equal_the_request_alone(tmp_path: Path, streams: int) -> None:
    server = start_server(tmp_path, "--served-model-name", MODEL)  # no inferd.toml in its folder: defaults
    try:
        together, alone = asyncio.run(together_and_alone(server.url, streams))
    finally:
        stop_server(server)
    assert all(together), together
    differ = [i for i in range(streams) if together[i] != alone[i]]
    assert not differ, [(i, together[i], alone[i]) for i in differ]
