"""A calculator agent written against the plain OpenAI SDK; it knows nothing about squall.

    async def agent(task, llm) -> float

sends a short system prompt and the question with one tool, `calculator(expression)`, runs the
tool calls itself (a safe arithmetic evaluator on Python's `ast`, no `eval`), and stops at the
first reply without tool calls, or after `MAX_TURNS` model calls. Reward: 1.0 when the last
integer in the final reply equals the task's answer, else 0.0.

As an external command (the task as JSON on stdin, the endpoint in OPENAI_BASE_URL /
OPENAI_API_KEY, model in OPENAI_MODEL or the server's first model), it prints the reward:

    echo '{"question": "...", "answer": 95}' | python -m examples.calc.agent
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import re
import sys
from typing import Any

SYSTEM_PROMPT = "Solve the problem. Reply with the number."
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOLS = [CALCULATOR_TOOL]
MAX_TURNS = 4  # model calls per task
MAX_TOKENS = 64  # per model call; a tool call is ~25 tokens, an answer < 10
MAX_EXPRESSION_CHARS = 200

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_INT_RE = re.compile(r"-?\d+")


class CalculatorError(ValueError):
    """The expression is not plain arithmetic on numbers, or cannot be evaluated."""


def calculate(expression: str) -> int | float:
    """Evaluate + - * / // % and parentheses on int/float literals; anything else is refused."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError("expression must be a string of at most 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from exc
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise CalculatorError(f"unsupported element {type(node).__name__}: only numbers and + - * / // % ( )")


def run_tool(name: str, arguments: str) -> str:
    """The text returned to the model for one tool call (errors are returned, not raised)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        expression = json.loads(arguments)["expression"]
        value = calculate(expression)
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def parse_answer(text: str | None) -> int | None:
    """The last integer in `text` (commas between digit groups allowed), or None."""
    if not text:
        return None
    found = _INT_RE.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def score(text: str | None, answer: int) -> float:
    return 1.0 if parse_answer(text) == int(answer) else 0.0


async def agent(task: dict, llm: Any) -> float:
    """Solve one task with the model behind `llm` (base_url, model, api_key); return the reward."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    final = None
    try:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model=llm.model, messages=messages, tools=TOOLS, temperature=1.0, max_tokens=MAX_TOKENS
            )
            message = response.choices[0].message
            if not message.tool_calls:
                final = message.content
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
    return score(final, task["answer"])


class _Endpoint:
    def __init__(self, base_url: str, model: str, api_key: str) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key


async def _main_async(task: dict) -> float:
    from openai import AsyncOpenAI

    base_url = os.environ["OPENAI_BASE_URL"]
    api_key = os.environ.get("OPENAI_API_KEY", "none")
    model = os.environ.get("OPENAI_MODEL")
    if not model:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            model = (await client.models.list()).data[0].id
    return await agent(task, _Endpoint(base_url, model, api_key))


def main() -> int:
    if "OPENAI_BASE_URL" not in os.environ:
        print("set OPENAI_BASE_URL to the OpenAI-compatible endpoint", file=sys.stderr)
        return 2
    task = json.load(sys.stdin)
    print(asyncio.run(_main_async(task)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
