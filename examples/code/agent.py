"""A code-interpreter agent (ReTool-like) on the plain OpenAI SDK: the model may run Python in
the tool pool's sandbox, then answers. It uses squall only through `squall.toolpool.client`,
which any program can import; the code never runs in the runner.

Two tool shapes, one sandbox:
- `agent`: the tool `python(code)`: the model writes a program and sees what it prints. For
  real models (examples/code/gpu.toml).
- `agent_expr`: the tool `calculator(expression)`, exactly the schema the committed 1.1M-param
  demo policy (examples/calc/policy) was warm-started on, because that policy cannot write
  programs. The agent wraps the expression as `print(<expression>)` and runs *that* in the
  sandbox. So the CPU config trains the real pool-and-sandbox path (every tool call is one rq
  job and one confined process), while the "code" the tiny model writes is one expression.

Reward: 1.0 when the last integer of the final reply equals the answer (examples.calc.agent.score).
"""

from __future__ import annotations

import json
from typing import Any

from examples.calc.agent import CALCULATOR_TOOL, MAX_TOKENS, MAX_TURNS, SYSTEM_PROMPT, score
from squall.toolpool.client import ToolError, arun_code

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program in a sandbox and return what it prints (stdout), or the error.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
CODE_SYSTEM_PROMPT = (
    "Solve the problem. You may run Python with the python tool (print the result). Reply with the number."
)
TOOL_DEADLINE_S = 20.0  # one tool call: queue wait + sandbox run


async def run_tool(name: str, arguments: str) -> str:
    """The text the model sees for one tool call; every failure is returned as `error: ...`."""
    try:
        args = json.loads(arguments)
        if name == "python":
            code = args["code"]
        elif name == "calculator":
            code = f"print({args['expression']})"
        else:
            return f"error: unknown tool {name!r}"
        if not isinstance(code, str):
            return "error: the program must be a string"
        result = await arun_code(code, deadline_s=TOOL_DEADLINE_S)
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: bad tool arguments: {exc}"
    except ToolError as exc:
        return f"error: {exc}"
    return result["text"].strip() or "(no output)"


async def _solve(task: dict, llm: Any, tools: list[dict], system: str) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": task["question"]},
    ]
    final = None
    try:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model=llm.model, messages=messages, tools=tools, temperature=1.0, max_tokens=MAX_TOKENS
            )
            message = response.choices[0].message
            if not message.tool_calls:
                final = message.content
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                output = await run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    finally:
        await client.close()
    return score(final, task["answer"])


async def agent(task: dict, llm: Any) -> float:
    """The `python(code)` tool; for models that can write programs."""
    return await _solve(task, llm, [PYTHON_TOOL], CODE_SYSTEM_PROMPT)


async def agent_expr(task: dict, llm: Any) -> float:
    """The calculator-shaped tool whose expression runs as `print(<expression>)` in the sandbox."""
    return await _solve(task, llm, [CALCULATOR_TOOL], SYSTEM_PROMPT)
