"""An OpenAI Agents SDK calculator agent, unchanged apart from the base URL. Runs as an
external command from its own venv (`make frameworks`: the SDK pins websockets and mcp
versions the main venv does not have):

    python tests/agents/openai_agents_calc.py < task.json   (prints the reward)

One Agent with a `function_tool` on the Chat Completions model over OPENAI_BASE_URL, run
streamed (`Runner.run_streamed`). The first call must use a tool (`tool_choice="required"`;
the SDK resets it to auto after the tool ran), so the calculator runs and its result goes back
to the model in the next call.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.calc
from examples.calc.agent import SYSTEM_PROMPT, run_tool, score  # noqa: E402


@function_tool
def calculator(expression: str) -> str:
    """Evaluate arithmetic"""
    return run_tool("calculator", json.dumps({"expression": expression}))


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
