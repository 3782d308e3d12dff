"""An OpenAI Agents SDK calculator agent, unchanged apart from the base URL. Runs as an
external command from its own venv (`make frameworks`: the SDK pins websockets and mcp
versions the main venv does not have):

    python tests/agents/openai_agents_calc.py < task.json   (prints the reward)

One Agent with a calculator tool on the Chat Completions model over OPENAI_BASE_URL, run
streamed (`Runner.run_streamed`). The first call must use a tool (`tool_choice="required"`;
the SDK resets it to auto after the tool ran), so the calculator runs and its result goes back
to the model in the next call. The tool is a `FunctionTool` with the JSON schema the tiny
policy was trained on (non-strict): the schema `@function_tool` derives from a signature adds
titles, `additionalProperties` and `strict`, and with it the tiny policy writes malformed calls
(docs/frameworks.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.calc
from examples.calc.agent import CALCULATOR_TOOL, SYSTEM_PROMPT, run_tool, score  # noqa: E402


async def run_calculator(context, arguments: str) -> str:
    return run_tool("calculator", arguments)


calculator = FunctionTool(
    name="calculator",
    description=CALCULATOR_TOOL["function"]["description"],
    params_json_schema=CALCULATOR_TOOL["function"]["parameters"],
    on_invoke_tool=run_calculator,
    strict_json_schema=False,
)


async def solve(question: str) -> str | None:
    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    client = AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ.get("OPENAI_API_KEY", "none"),
                         max_retries=0)  # fmt: skip
    model = OpenAIChatCompletionsModel(model=os.environ.get("OPENAI_MODEL", "policy"), openai_client=client)
    agent = Agent(name="calculator_agent", instructions=SYSTEM_PROMPT, tools=[calculator], model=model,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=64))  # fmt: skip
    result = Runner.run_streamed(agent, question, max_turns=4)
    async for _ in result.stream_events():
        pass
    return str(result.final_output)


def main() -> int:
    task = json.load(sys.stdin)
    print(score(asyncio.run(solve(task["question"])), task["answer"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
