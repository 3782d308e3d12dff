"""A CrewAI crew of two agents, unchanged apart from their base URLs. Runs as an external
command from its own venv (`make frameworks`: CrewAI pins openai 2 and pydantic 2.12):

    python tests/agents/crewai_calc.py < task.json   (prints the reward)

A sequential crew: a solver (with a calculator tool) and a checker, each an `LLM("openai/...")`
on its own per-agent URL (`.../agent/solver/v1`, `.../agent/checker/v1`), so the gateway
attributes every call. CrewAI writes its own (long) system prompts around the role, goal and
backstory given here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # no exporters: nothing outside is reachable
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

from crewai import LLM, Agent, Crew, Process, Task  # noqa: E402
from crewai.tools import tool  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.calc
from examples.calc.agent import SYSTEM_PROMPT, run_tool, score  # noqa: E402


@tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate arithmetic"""
    return run_tool("calculator", json.dumps({"expression": expression}))


def llm(agent: str) -> LLM:
    base = os.environ["OPENAI_BASE_URL"].rstrip("/").removesuffix("/v1") + f"/agent/{agent}/v1"
    return LLM(model="openai/" + os.environ.get("OPENAI_MODEL", "policy"), base_url=base,
               api_key=os.environ.get("OPENAI_API_KEY", "none"), max_tokens=64, max_retries=0)  # fmt: skip


def solve(question: str) -> str:
    solver = Agent(role="Solver", goal=SYSTEM_PROMPT, backstory="You use the calculator for arithmetic.",
                   tools=[calculator], llm=llm("solver"), max_iter=3, allow_delegation=False)  # fmt: skip
    checker = Agent(role="Checker", goal="Check the answer. Reply with the number.", backstory="You check sums.",
                    llm=llm("checker"), max_iter=2, allow_delegation=False)  # fmt: skip
    first = Task(description=question, expected_output="The number.", agent=solver)
    second = Task(description=f"Check the answer to: {question}", expected_output="The number.", agent=checker,
                  context=[first])  # fmt: skip
    crew = Crew(agents=[solver, checker], tasks=[first, second], process=Process.sequential)
    return crew.kickoff().raw


def main() -> int:
    task = json.load(sys.stdin)
    print(score(solve(task["question"]), task["answer"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
