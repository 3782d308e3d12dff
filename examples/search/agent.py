"""A multi-hop search agent (Search-R1-like) on the plain OpenAI SDK.

Before the first model call the agent searches the question itself and puts the top 3
passages in the prompt (one hop is then usually in view); the model may call `search(query)`
for the next hop. Every search goes to the tool pool's `retrieval` queue (BM25 over the
generated corpus, served by `squall worker`, see squall.toolpool.client). It answers when it replies without a tool call, at most
`MAX_TURNS` model calls. Reward (`reward`): 1.0 when the final reply, normalised (lower case,
no punctuation or articles), equals the answer or ends with it; else 0.0.
"""

from __future__ import annotations

import json
from typing import Any

from squall.toolpool.client import ToolError, asearch
from squall.toolpool.judges import normalize

SYSTEM_PROMPT = "Answer the question. Use the search tool to look facts up; it may take several searches. Reply with the answer only."
SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the encyclopedia; returns the best matching passages.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
MAX_TURNS = 5
MAX_TOKENS = 96
TOP_K = 3
TOOL_DEADLINE_S = 10.0


def reward(final: str | None, answer: str) -> float:
    """1.0 for the right answer (exact after normalisation, or the reply's last words), else 0.0."""
    got, want = normalize(final or ""), normalize(answer)
    return float(bool(want) and (got == want or got.endswith(" " + want)))


async def run_tool(name: str, arguments: str) -> str:
    if name != "search":
        return f"error: unknown tool {name!r}; the only tool is search(query)"
    try:
        query = json.loads(arguments)["query"]
        hits = await asearch(query, k=TOP_K, deadline_s=TOOL_DEADLINE_S)
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: bad tool arguments: {exc}"
    except ToolError as exc:
        return f"error: {exc}"
    return "\n".join(f"[{h['title']}] {h['text']}" for h in hits) or "no results"


async def agent(task: dict, llm: Any) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0)
    first = await run_tool("search", json.dumps({"query": task["question"]}))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{task['question']}\n\nSearch results:\n{first}"},
    ]
    final = None
    try:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model=llm.model,
                messages=messages,
                tools=[SEARCH_TOOL],
                temperature=1.0,
                max_tokens=MAX_TOKENS,
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
    return reward(final, task["answer"])
