"""A grammar the client sends is the client's: one llguidance cannot serve is a 400 (at the
door where its first token tells, else an invalid_request_error once generation meets the
limit), never a 500 that tells the client to retry; fuzzed grammars never make a 5xx or a hang."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from apiserver import MODEL, Server, assert_error, data_events, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferd.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.served]

LOOPING_REFS = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def completion(response_format: dict[str, Any], max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Answer:", "max_tokens": max_tokens, "temperature": 0,
            "response_format": response_format, **fields}


def schema(s: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}


async def test_refs_that_loop_without_a_type_are_a_400_at_the_door(server: Server) -> None:
    status, body = await server.post("/v1/completions", completion(schema(LOOPING_REFS)))
    assert_error(status, body, 400, code="invalid_grammar")
    response, events = await server.stream("/v1/completions", completion(schema(LOOPING_REFS)))
    assert response.status == 400 and "invalid_grammar" in events[0]  # refused before the stream opens


async def test_a_grammar_that_fails_mid_generation_ends_as_the_clients_error(server: Server) -> None:
    """A Lark grammar whose only sentence is longer than what llguidance lets one lexeme be
    explored to: it compiles and starts, then fails at some token."""
    lark = 'start: "x" NUM\nNUM: /[0-9]{1000}{1000}/'
    status, body = await server.post("/v1/completions", completion({"type": "grammar", "grammar": lark},
                                                                    max_tokens=16))
    assert status < 500, body
    if status == 200:  # (llguidance may serve it after all: then the answer keeps to it)
        assert body["choices"][0]["text"].startswith("x")
    else:
        assert_error(status, body, 400, code="invalid_grammar")


async def test_a_grammar_error_after_the_first_token_is_an_invalid_request_event(llm: LLMEngine) -> None:
    """The engine-side path itself: a constraint that gives up after its first token (as a
    limit met mid-answer does) ends the request with a 400 whole, and a final invalid_request
    error event streamed; the engine stays healthy."""
    from inferd.engine.protocol import ConstraintError

    class GivesUp:
        def __init__(self) -> None:
            self.accepted = 0

        def fill_mask(self, mask: Any) -> None:
            if self.accepted:
                raise ConstraintError("too many expressions constructed (a planted limit)")
            mask[:] = -1

        def accept(self, token_id: int) -> None:
            self.accepted += 1

        def fork(self) -> GivesUp:
            return GivesUp()

    async with serve(llm) as server:
        door = server.door
        real = door._constraints

        async def planted(ask: Any, prompts: int) -> list[Any] | None:
            return None if ask.grammar is None else [GivesUp() for _ in range(prompts)]

        door._constraints = planted  # (the door's own compile is what the tests above check)
        try:
            status, body = await server.post("/v1/completions", completion({"type": "json_object"}))
            assert_error(status, body, 400, code="invalid_grammar")
            response, events = await server.stream("/v1/completions", completion({"type": "json_object"}))
            *_, error = data_events(events)
            assert response.status == 200 and error["error"]["type"] == "invalid_request_error", events[-3:]
            assert error["error"]["code"] == "invalid_grammar"
        finally:
            door._constraints = real
        _, health = await server.get("/health")
        assert health["status"] == "ok", health


REGEX_PIECES = st.sampled_from(["a", "[0-9]", "(ab|c)", ".", "\\d", "x{3}", "(a|b)*", "[^z]+", "(", ")", "{1000}",
                                "{2,5}", "?", "*", "+", "\\", "|", "^", "$", "[", "]"])
SCHEMA_TYPES = st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array", "nonsense"])


@st.composite
def json_schemas(draw: st.DrawFn, depth: int = 0) -> dict[str, Any]:
    kind = draw(st.sampled_from(["type", "ref", "enum", "anyOf", "props"] if depth < 3 else ["type", "enum"]))
    if kind == "type":
        out: dict[str, Any] = {"type": draw(SCHEMA_TYPES)}
        if draw(st.booleans()):
            out["minLength" if out["type"] == "string" else "minimum"] = draw(st.integers(-5, 5000))
        return out
    if kind == "ref":
        return {"$defs": {"d": draw(json_schemas(depth=depth + 1))}, "$ref": draw(st.sampled_from(
            ["#/$defs/d", "#/$defs/missing", "#"]))}
    if kind == "enum":
        return {"enum": draw(st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=3))}
    if kind == "anyOf":
        return {"anyOf": draw(st.lists(json_schemas(depth=depth + 1), max_size=3))}
    return {"type": "object", "properties": draw(st.dictionaries(st.text("abc", min_size=1, max_size=3),
                                                                  json_schemas(depth=depth + 1), max_size=3)),
            "required": draw(st.lists(st.text("abc", min_size=1, max_size=3), max_size=2))}


response_formats = st.one_of(
    json_schemas().map(schema),
    st.lists(REGEX_PIECES, min_size=1, max_size=8).map(lambda p: {"type": "regex", "regex": "".join(p)}),
    st.lists(st.sampled_from(['start: a', 'a: "x" a | "y"', 'a: a a | "z"', 'start: /[0-9]+/', 'b: c\nc: b',
                              'start: b', '%ignore " "', 'start: "q"{3}', 'start: "']), min_size=1, max_size=4)
    .map(lambda lines: {"type": "grammar", "grammar": "\n".join(lines)}),
)


@pytest.mark.parametrize("examples", [pytest.param(200, marks=pytest.mark.soak), 25])
async def test_fuzzed_grammars_never_make_a_server_error_or_a_hang(server: Server, examples: int) -> None:
    seen: list[dict[str, Any]] = []

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(response_formats)
    def draw(response_format: dict[str, Any]) -> None:
        seen.append(response_format)

    draw()  # (hypothesis draws synchronously; the requests run on this test's loop below)
    for response_format in seen:
        body = completion(response_format, max_tokens=4)
        status, reply = await asyncio.wait_for(server.post("/v1/completions", body), 60)
        assert status in (200, 400), (json.dumps(response_format), status, reply)
        if status == 400:
            assert reply["error"]["type"] == "invalid_request_error", reply
