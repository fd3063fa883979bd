"""The OpenAI Agents SDK, unchanged, against inferd over a real socket: its Responses model (the
SDK's default kind) runs a function-tool loop to a final answer. The first turn is required to
call (the SDK resets `tool_choice` to auto once its tool has run, so the loop ends); the tool
runs exactly once and the final answer is text. Tracing is off: nothing leaves 127.0.0.1."""

from __future__ import annotations

import json

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from apiserver import MODEL, Server, assert_pool_whole

pytestmark = pytest.mark.served  # it starts a real server

set_tracing_disabled(True)


@pytest.mark.asyncio
async def test_an_agent_calls_its_tool_once_and_answers(server: Server) -> None:
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "weather": "18 degrees and sunny"})

    client = openai.AsyncOpenAI(base_url=str(server.test_server.make_url("/v1")), api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tool's result, briefly.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=96))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1 and calls[0]  # the tool ran once, with a city
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    await assert_pool_whole(server.engine, server.door)
