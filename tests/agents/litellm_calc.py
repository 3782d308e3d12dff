"""The calculator agent on LiteLLM as its client (`litellm.acompletion`, provider `openai/`
with `api_base`), unchanged apart from the base URL. Runs as an external command from its own
venv (`make frameworks`: LiteLLM pins openai 2):

    python tests/agents/litellm_calc.py < task.json   (prints the reward)

The first call must use the tool (tool_choice "required"); the agent runs it and asks again,
streamed, folding the chunks back with `litellm.stream_chunk_builder`, until a reply has no
tool call (at most MAX_TURNS calls).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the price list

import litellm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.calc
from examples.calc.agent import MAX_TURNS, SYSTEM_PROMPT, TOOLS, run_tool, score  # noqa: E402


async def solve(question: str) -> str | None:
    endpoint = {"model": "openai/" + os.environ.get("OPENAI_MODEL", "policy"), "api_base": os.environ["OPENAI_BASE_URL"],
                "api_key": os.environ.get("OPENAI_API_KEY", "none"), "max_tokens": 64, "num_retries": 0}  # fmt: skip
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    reply = await litellm.acompletion(messages=messages, tools=TOOLS, tool_choice="required", **endpoint)
    for _ in range(MAX_TURNS - 1):
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in message.tool_calls]  # fmt: skip
        messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
        for call in calls:
            result = run_tool(call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        stream = await litellm.acompletion(messages=messages, tools=TOOLS, stream=True, **endpoint)
        chunks = [chunk async for chunk in stream]
        reply = litellm.stream_chunk_builder(chunks, messages=messages)
    return reply.choices[0].message.content


def main() -> int:
    task = json.load(sys.stdin)
    print(score(asyncio.run(solve(task["question"])), task["answer"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
