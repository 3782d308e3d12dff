"""A Youtu-agent (`youtu-agent` 0.1.3) calculator agent, unchanged apart from its config file.
Runs as an external command from its own Python 3.12 venv (`make youtu`: it needs Python >= 3.12
and pins openai-agents 0.3.3):

    python tests/agents/youtu_calc.py < task.json   (prints the reward)

Youtu's SimpleAgent, configured by `youtu_calc.yaml` (its AgentConfig format, loaded with
omegaconf as Youtu's own loader does; the model settings point at OPENAI_BASE_URL), with the
calculator as its one tool. The first call must use the tool (`tool_choice: required`; the
Agents SDK underneath resets it after the tool ran). The tool is a `FunctionTool` with the JSON
schema the tiny policy was trained on, and the instructions are its training system prompt, as
for the Agents SDK agent (docs/frameworks.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import tiktoken
import tiktoken.registry

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repo root, for examples.calc
from examples.calc.agent import CALCULATOR_TOOL, SYSTEM_PROMPT, run_tool, score  # noqa: E402


def offline_tiktoken() -> None:
    """Youtu loads tiktoken's cl100k_base when imported (utu/utils/token.py, to count tokens for
    its context trimming), which tiktoken downloads from openaipublic.blob.core.windows.net. Where
    that cannot be reached (CI here reaches only package indexes), register a byte-level stand-in
    under that name first: token counts become byte counts; nothing sent to the model changes."""
    try:
        tiktoken.get_encoding("cl100k_base")
    except Exception:
        ranks = {bytes([b]): b for b in range(256)}
        tiktoken.registry.ENCODINGS["cl100k_base"] = tiktoken.Encoding(
            name="cl100k_base",
            pat_str=r"[\s\S]",
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": 256},
        )


offline_tiktoken()
# Youtu reads its model settings from UTU_LLM_* when imported (its config defaults): the same
# attempt endpoint the config file names.
for name, source in (
    ("MODEL", "OPENAI_MODEL"),
    ("BASE_URL", "OPENAI_BASE_URL"),
    ("API_KEY", "OPENAI_API_KEY"),
):
    os.environ.setdefault(f"UTU_LLM_{name}", os.environ.get(source, "policy"))
os.environ.setdefault("UTU_LLM_TYPE", "chat.completions")
from agents import FunctionTool  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from utu.agents import SimpleAgent  # noqa: E402
from utu.config import AgentConfig  # noqa: E402


async def run_calculator(context, arguments: str) -> str:
    return run_tool("calculator", arguments)


calculator = FunctionTool(
    name="calculator",
    description=CALCULATOR_TOOL["function"]["description"],
    params_json_schema=CALCULATOR_TOOL["function"]["parameters"],
    on_invoke_tool=run_calculator,
    strict_json_schema=False,
)


async def solve(question: str) -> str:
    raw = OmegaConf.to_container(OmegaConf.load(HERE / "youtu_calc.yaml"), resolve=True)
    config = AgentConfig(**raw)
    async with SimpleAgent(config=config, instructions=SYSTEM_PROMPT, tools=[calculator]) as agent:
        recorder = await agent.run(question, log_to_db=False)
    return str(recorder.final_output)


def main() -> int:
    task = json.load(sys.stdin)
    print(score(asyncio.run(solve(task["question"])), task["answer"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
