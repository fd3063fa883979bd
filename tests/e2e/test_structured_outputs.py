"""Structured outputs and tool calls as the official `openai` client asks for them, from a real
`inferd serve` subprocess: seeds at temperature 1.0 for each kind (20 in the soak tier, 1 in the
default one), every answer checked (json.loads, jsonschema), streamed and not; the client's
`parse()` with a pydantic model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from serveproc import Server, start_server, stop_server

pytestmark = pytest.mark.served  # it starts a real server

MODEL = "smollm2"
SEEDS = [pytest.param(range(20), marks=pytest.mark.soak, id="20-seeds"), pytest.param(range(1), id="1-seed")]
RECIPE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "vegetarian": {"type": "boolean"},
        "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 6},
    },
    "required": ["name", "servings", "vegetarian", "ingredients"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
FLIGHTS = {"type": "function", "function": {
    "name": "find_flights", "description": "Flights between two airports on a day",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"}, "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "pattern": "^2026-[0-9]{2}-[0-9]{2}$"}},
        "required": ["origin", "destination", "date"], "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, FLIGHTS)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("structured"), "--served-model-name", MODEL,
                       "--kv-cache-memory", "256MiB", "--max-num-seqs", "32")
    yield srv
    stop_server(srv)


def client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(params=SEEDS)
def seeds(request: pytest.FixtureRequest) -> range:
    return request.param


async def for_each_seed(seeds: range, call: Any) -> list[Any]:
    return await asyncio.gather(*(call(seed) for seed in seeds))


def test_every_json_schema_answer_validates(server: Server, seeds: range) -> None:
    async def main() -> list[Any]:
        async with client(server) as c:
            return await for_each_seed(seeds, lambda seed: c.chat.completions.create(
                model=MODEL, messages=user("Give me a recipe as JSON."), temperature=1.0, seed=seed, max_tokens=300,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "recipe", "schema": RECIPE, "strict": True}}))

    for reply in asyncio.run(main()):
        [choice] = reply.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), RECIPE)


def test_every_json_object_answer_parses(server: Server, seeds: range) -> None:
    async def main() -> list[Any]:
        async with client(server) as c:
            return await for_each_seed(seeds, lambda seed: c.chat.completions.create(
                model=MODEL, messages=user("Describe your favourite animal in JSON."), temperature=1.0, seed=seed,
                max_tokens=1000, response_format={"type": "json_object"}))

    for reply in asyncio.run(main()):
        [choice] = reply.choices
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content), dict)


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_required_tool_call_has_arguments_that_validate(server: Server, seeds: range) -> None:
    """Each seed whole and streamed, the two at once (one batch on the server)."""
    async def one(c: openai.AsyncOpenAI, seed: int, stream: bool) -> tuple[str | None, list[Any]]:
        request = dict(model=MODEL, messages=user("Is it raining in Lisbon? Or find me a flight LIS to OSL."),
                       tools=[WEATHER, FLIGHTS], tool_choice="required", temperature=1.0, seed=seed, max_tokens=400)
        if not stream:
            reply = await c.chat.completions.create(**request)
            return reply.choices[0].finish_reason, reply.choices[0].message.tool_calls or []
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        async for chunk in await c.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for part in choice.delta.tool_calls or []:
                    call = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
                    call["arguments"] += part.function.arguments or ""
        return finish, [openai.types.chat.ChatCompletionMessageToolCall.model_validate(
            {"id": v["id"], "type": "function", "function": {"name": v["name"], "arguments": v["arguments"]}})
            for _, v in sorted(calls.items())]

    async def main() -> list[tuple[str | None, list[Any]]]:
        async with client(server) as c:
            return await asyncio.gather(*(one(c, seed, stream) for seed in seeds for stream in (False, True)))

    for finish, calls in asyncio.run(main()):
        assert finish == "tool_calls" and calls
        for call in calls:
            check_call(call)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int
    languages: list[str] = pydantic.Field(max_length=3)


def test_the_clients_parse_helper_with_a_pydantic_model(server: Server) -> None:
    async def main() -> list[Any]:
        async with client(server) as c:
            return await asyncio.gather(*(c.chat.completions.parse(
                model=MODEL, messages=user("Invent a person who speaks some languages."), response_format=Person,
                temperature=temperature, seed=1, max_tokens=200) for temperature in (0.0, 1.0)))

    for reply in asyncio.run(main()):
        person = reply.choices[0].message.parsed
        assert isinstance(person, Person) and len(person.languages) <= 3
