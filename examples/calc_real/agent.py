"""A calculator agent for a real 135M chat model (SmolLM2-135M-Instruct), plain OpenAI SDK.

    async def agent(task, llm) -> float

Designed for what a 135M model can do (examples/calc_real/README.md has the reasoning):
- no system prompt of our own: the server writes the tools into the system prompt in the form
  the model was tuned on (its template has no tool support; docs/inference.md), so the prompt
  is the model's familiar one plus the question;
- turn 1 asks for a calculator call (`tool_choice` names it: the server prefills
  `<tool_call>[{"name": "calculator`, and the model writes the arguments itself) and stops at
  `</tool_call>`, so the model does not run on into an invented result;
- turn 2 gets the tool's result and answers freely (tools still offered, tool_choice auto);
- reward, graded for a model that starts near 0 (so GRPO groups have variance from the first
  step): 1.0 when the last integer of the final answer is the product; 0.5 when only the
  calculator call was right (its result is the product); 0.1 for a call that parsed at all
  (at temperature 1 the untrained model writes broken JSON in about 3 calls of 4); else 0.
- with CALC_REAL_LOG set, one JSON line per attempt is appended to that file (task id, end
  time, whether the call parsed, reward), for the tool-call rate per weight version
  (`python -m examples.calc_real.report RUN_DIR`, which dates versions from metrics.jsonl).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from examples.calc.agent import CALCULATOR_TOOL, parse_answer, run_tool

TOOLS = [CALCULATOR_TOOL]
FORCE_CALCULATOR = {"type": "function", "function": {"name": "calculator"}}
CALL_TOKENS = 32  # `", "arguments": {"expression": "37 * 48"}}]` is ~15 tokens
ANSWER_TOKENS = 32
RIGHT_CALL_REWARD = 0.5
PARSED_CALL_REWARD = 0.1


async def agent(task: dict, llm: Any) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    final, results, called = None, [], False
    try:
        first = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, tool_choice=FORCE_CALCULATOR,
            temperature=1.0, max_tokens=CALL_TOKENS, stop=["</tool_call>"],
        )  # fmt: skip
        message = first.choices[0].message
        called = bool(message.tool_calls)
        if called:
            messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            for call in message.tool_calls or []:
                results.append(run_tool(call.function.name, call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": results[-1]})
            second = await client.chat.completions.create(
                model=llm.model, messages=messages, tools=TOOLS, temperature=1.0, max_tokens=ANSWER_TOKENS
            )
            final = second.choices[0].message.content
    finally:
        await client.close()
    reward = reward_of(task, called, results, final)
    if os.environ.get("CALC_REAL_LOG"):
        line = {"id": task["id"], "time": time.time(), "called": called, "reward": reward}
        with open(os.environ["CALC_REAL_LOG"], "a") as log:
            log.write(json.dumps(line) + "\n")
    return reward


def reward_of(task: dict, called: bool, results: list[str], final: str | None) -> float:
    if not called:
        return 0.0
    if parse_answer(final) == int(task["answer"]):
        return 1.0
    return RIGHT_CALL_REWARD if str(task["answer"]) in results else PARSED_CALL_REWARD
