"""A real agent framework against the gateway, unchanged: the OpenAI Agents SDK.

Run by cli/tests/gateway.rs after gateway_clients.py, against the same running
system. The agent has one Python function as its tool; the SDK sends it to the
gateway through the Responses API (its default) and through Chat Completions,
runs the function with the arguments the model wrote and, told to stop at the
first tool, returns the function's result. Exits non-zero on the first failure.
"""
import os
import sys
from typing import Literal

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

BASE = os.environ["GATEWAY"]
KEY = os.environ["API_KEY"]
DAILY, PIPE = os.environ["DAILY"], os.environ["PIPE"]

set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI
client = AsyncOpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0)
received = []


@function_tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city.

    Args:
        city: The city.
        unit: The temperature unit.
    """
    received.append((city, unit))
    return f"22 degrees {unit} and sunny in {city}"


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


for label, model in [
    ("responses API", OpenAIResponsesModel(model=DAILY, openai_client=client)),
    ("chat completions, pipeline", OpenAIChatCompletionsModel(model=PIPE, openai_client=client)),
]:
    received.clear()
    agent = Agent(name="weather", instructions="You answer questions about the weather.", model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80, parallel_tool_calls=False),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    check(len(received) == 1 and received[0][0] and received[0][1] in ("celsius", "fahrenheit"),
          f"agents SDK ({label}): the tool received valid arguments: {received}")
    city, unit = received[0]
    check(result.final_output == f"22 degrees {unit} and sunny in {city}",
          f"agents SDK ({label}): the run ends with the tool's result: {result.final_output!r}")
print("all agent framework checks passed")
