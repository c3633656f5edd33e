"""The agent frameworks that speak the Responses API, run unchanged against real processes (an
API replica, a worker, Redis): the OpenAI Agents SDK with one function tool, and LangChain's
`ChatOpenAI(use_responses_api=True)`. Only the base URL and the model name point them at redserve;
what they send and parse is their own, so a field they always send or an event shape they expect
shows up here rather than in a user's agent. The tiny model is random, so the tool call is forced
(`tool_choice`) and the turns are capped; the grammar keeps its arguments valid JSON."""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.stack import Stack

MODEL = "tiny-llama"
CITIES = {"Paris", "Tokyo"}
WEATHER: dict[str, Any] = {
    "type": "function", "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": sorted(CITIES)}},
                   "required": ["city"], "additionalProperties": False}}


class Report(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


@pytest.fixture(scope="module")
def responses_model(tiny_stack: Stack) -> OpenAIResponsesModel:
    # The SDK would otherwise export its traces to OpenAI's servers.
    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="test",
                                max_retries=0, timeout=60)
    return OpenAIResponsesModel(model=MODEL, openai_client=client)


def _weather_agent(model: OpenAIResponsesModel, calls: list[str]) -> Agent[Any]:
    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    # The tool is forced on the first turn; the SDK resets tool_choice after a call, so the
    # second turn (the tool's output fed back) answers. The SDK takes an answer cut short by
    # max_output_tokens as a failure, so the answer is a bounded JSON schema (`output_type`: the
    # SDK sends it as `text.format`), which the grammar makes the random model finish.
    return Agent(name="weather", instructions="Answer with the weather.", model=model,
                 tools=[get_weather], output_type=Report,
                 model_settings=ModelSettings(tool_choice="get_weather", temperature=0,
                                              max_tokens=64))


def _tool_call(items: list[Any], calls: list[str]) -> None:
    [call] = [i for i in items if isinstance(i, ToolCallItem)]
    [output] = [i for i in items if isinstance(i, ToolCallOutputItem)]
    raw: Any = call.raw_item
    assert raw.name == "get_weather"
    city = json.loads(raw.arguments)["city"]
    assert city in CITIES and calls == [city]
    assert output.output == f"Sunny in {city}"


async def test_agents_sdk_runs_a_function_tool(responses_model: OpenAIResponsesModel) -> None:
    calls: list[str] = []
    result = await Runner.run(_weather_agent(responses_model, calls), "Weather in Paris?",
                              max_turns=3)
    _tool_call(result.new_items, calls)
    assert isinstance(result.final_output, Report)
    # Two model calls: the forced tool call, then the answer after its output.
    assert len(result.raw_responses) == 2
    assert all(r.usage.output_tokens > 0 for r in result.raw_responses)


async def test_agents_sdk_streams_a_run(responses_model: OpenAIResponsesModel) -> None:
    calls: list[str] = []
    result = Runner.run_streamed(_weather_agent(responses_model, calls), "Weather in Tokyo?",
                                 max_turns=3)
    names = [e.name async for e in result.stream_events() if e.type == "run_item_stream_event"]
    assert names[:2] == ["tool_called", "tool_output"]
    _tool_call(result.new_items, calls)
    assert isinstance(result.final_output, Report) and result.is_complete


@pytest.fixture(scope="module")
def chat(tiny_stack: Stack) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key="test",  # type: ignore[arg-type]
                      model=MODEL, use_responses_api=True, temperature=0, max_tokens=12,  # type: ignore[call-arg]
                      max_retries=0, timeout=60)


def test_langchain_invokes_and_streams(chat: ChatOpenAI) -> None:
    message = chat.invoke("Hello there")
    assert isinstance(message, AIMessage) and message.text
    assert message.usage_metadata is not None
    assert message.usage_metadata["output_tokens"] == 12
    assert message.usage_metadata["input_tokens"] > 0
    chunks = list(chat.stream("Hello there"))
    assert len(chunks) > 1 and all(isinstance(c, AIMessageChunk) for c in chunks)
    # Greedy: the stream's pieces join to the same text the unstreamed call gave.
    assert "".join(c.text for c in chunks) == message.text


def test_langchain_bound_tool_is_called(chat: ChatOpenAI) -> None:
    # Room for the whole call: one cut short by max_output_tokens is no call.
    roomy = chat.model_copy(update={"max_tokens": 64})
    bound = roomy.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("Weather in Paris?")
    assert isinstance(message, AIMessage)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITIES
    # Streamed, the call's chunks add up to the same call (greedy).
    chunks = list(bound.stream("Weather in Paris?"))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [(call["name"], call["args"])]
