"""A calculator agent for a real 135M chat model (SmolLM2-135M-Instruct), plain OpenAI SDK.

    async def agent(task, llm) -> float

Designed for what a 135M model can do (examples/calc_real/README.md has the reasoning):
- no system prompt of our own: the run's chat template (examples/calc_real/chat_template.jinja,
  `inference.chat_template`) is SmolLM2's ChatML plus a short tools block in the
  `<tool_call>[...]</tool_call>` form the model was tuned on, 140 tokens instead of the server's
  generic 220-token fallback; one worked exchange (DEMONSTRATION) comes before the question;
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
# One worked exchange before the question, in the model's own tool format: without it the model
# copies the tool's schema ("description": ...) into its call instead of arguments (1 call in 16
# parsed on our probes); with it 9 in 16 parsed and 6 were the right product (README.md).
DEMONSTRATION: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 12 * 34?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "demo",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "12 * 34"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "demo", "content": "408"},
    {"role": "assistant", "content": "12 * 34 = 408"},
]
PARSED_CALL_REWARD = 0.1


async def agent(task: dict, llm: Any) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0)
    messages: list[dict[str, Any]] = [*DEMONSTRATION, {"role": "user", "content": task["question"]}]
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
        line = {
            "id": task["id"],
            "time": time.time(),
            "called": called,
            "right_call": str(task["answer"]) in results,
            "reward": reward,
        }
        with open(os.environ["CALC_REAL_LOG"], "a") as log:
            log.write(json.dumps(line) + "\n")
    return reward


def reward_of(task: dict, called: bool, results: list[str], final: str | None) -> float:
    if not called:
        return 0.0
    if parse_answer(final) == int(task["answer"]):
        return 1.0
    return RIGHT_CALL_REWARD if str(task["answer"]) in results else PARSED_CALL_REWARD
