"""A calculator agent for a real 135M chat model (SmolLM2-135M-Instruct), plain OpenAI SDK.

    async def agent(task, llm) -> float

Designed for what a 135M model can do (docs/examples.md has the reasoning):
- no system prompt of our own: the server writes the tools into the system prompt in the form
  the model was tuned on (the template has no tool support; docs/inference.md), so the prompt
  is the model's familiar one plus the question;
- turn 1 asks for a calculator call (`tool_choice` names it: the server prefills
  `<tool_call>[{"name": "calculator`, and the model writes the arguments itself) and stops at
  `</tool_call>`, so the model does not run on into an invented result;
- turn 2 gets the tool's result and answers freely (tools still offered, tool_choice auto);
- reward: 1.0 when the last integer of the final answer is the product; 0.25 when only the
  calculator call was right (its result is the product) — a graded signal for a model that
  starts near 0, so GRPO groups have variance from the first step.
"""

from __future__ import annotations

import json
from typing import Any

from examples.calc.agent import CALCULATOR_TOOL, parse_answer, run_tool

TOOLS = [CALCULATOR_TOOL]
FORCE_CALCULATOR = {"type": "function", "function": {"name": "calculator"}}
CALL_TOKENS = 32  # `", "arguments": {"expression": "37 * 48"}}]` is ~15 tokens
ANSWER_TOKENS = 32
RIGHT_CALL_REWARD = 0.25


async def agent(task: dict, llm: Any) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    try:
        first = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, tool_choice=FORCE_CALCULATOR,
            temperature=1.0, max_tokens=CALL_TOKENS, stop=["</tool_call>"],
        )  # fmt: skip
        message = first.choices[0].message
        if not message.tool_calls:
            return 0.0  # the call did not parse: no tool result to answer from
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        results = []
        for call in message.tool_calls:
            results.append(run_tool(call.function.name, call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": results[-1]})
        second = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, temperature=1.0, max_tokens=ANSWER_TOKENS
        )
        final = second.choices[0].message.content
    finally:
        await client.close()
    if parse_answer(final) == int(task["answer"]):
        return 1.0
    return RIGHT_CALL_REWARD if str(task["answer"]) in results else 0.0


