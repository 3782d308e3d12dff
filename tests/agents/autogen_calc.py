"""AutoGen AgentChat calculator agents, unchanged apart from the base URL (as Agent Lightning's
calc_x example uses AutoGen: an AssistantAgent with a calculator tool that reflects on the
tool's result). Runs as an external command from its own venv (`make frameworks`):

    python tests/agents/autogen_calc.py single|team   < task.json   (prints the reward)

`single`: one AssistantAgent on OPENAI_BASE_URL. `team`: a RoundRobinGroupChat of a solver
(with the tool) and a checker, each on its own per-agent URL (`.../agent/solver/v1`,
`.../agent/checker/v1`), streaming, so the gateway attributes every call to its agent.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_ext.models.openai import OpenAIChatCompletionClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.calc
from examples.calc.agent import SYSTEM_PROMPT, run_tool, score  # noqa: E402

MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
              "structured_output": False}  # fmt: skip


def calculator(expression: str) -> str:
    """Evaluate arithmetic"""
    return run_tool("calculator", json.dumps({"expression": expression}))


def client(base_url: str) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(
        model=os.environ.get("OPENAI_MODEL", "policy"), base_url=base_url,
        api_key=os.environ.get("OPENAI_API_KEY", "none"), model_info=MODEL_INFO, max_tokens=64, max_retries=0,
    )  # fmt: skip


def agent_url(name: str) -> str:
    return os.environ["OPENAI_BASE_URL"].rstrip("/").removesuffix("/v1") + f"/agent/{name}/v1"


async def single(question: str) -> str | None:
    solver = AssistantAgent("solver", model_client=client(os.environ["OPENAI_BASE_URL"]), tools=[calculator],
                            system_message=SYSTEM_PROMPT, reflect_on_tool_use=True)  # fmt: skip
    result = await solver.run(task=question)
    return result.messages[-1].to_text()


async def team(question: str) -> str | None:
    solver = AssistantAgent("solver", model_client=client(agent_url("solver")), tools=[calculator],
                            system_message=SYSTEM_PROMPT, reflect_on_tool_use=True, model_client_stream=True)  # fmt: skip
    checker = AssistantAgent("checker", model_client=client(agent_url("checker")),
                             system_message="Check the answer. Reply with the number.", model_client_stream=True)  # fmt: skip
    group = RoundRobinGroupChat([solver, checker], termination_condition=MaxMessageTermination(3))
    result = await group.run(task=question)
    return result.messages[-1].to_text()


def main() -> int:
    task = json.load(sys.stdin)
    final = asyncio.run({"single": single, "team": team}[sys.argv[1]](task["question"]))
    print(score(final, task["answer"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
