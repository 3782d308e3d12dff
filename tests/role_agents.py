"""Agents of a run with two trained roles (tests/test_roles_gateway.py): each reports what the
gateway did with its calls through its reward table, since an agent sees only replies."""

from __future__ import annotations


async def two_seats(task: dict, llm) -> dict[str, float]:
    """The wolf's call must be served (its role's adapter); the villager asks for a model of its
    own choosing and must reach the node as `villagers` (served, or refused by a node that serves
    no such adapter: the refusal names the model the node was asked for). A pinned snapshot
    `wolves@0` from the villager's seat reaches the node under exactly that name."""
    import openai
    from openai import AsyncOpenAI

    ask = [{"role": "user", "content": "vote?"}]
    wolf = AsyncOpenAI(base_url=llm.agent_url("wolf"), api_key=llm.api_key, max_retries=0)
    vil = AsyncOpenAI(base_url=llm.agent_url("vil"), api_key=llm.api_key, max_retries=0)
    reply = await wolf.chat.completions.create(model="whatever-the-agent-says", messages=ask, max_tokens=3)
    wolf_ok = float(reply.model == "whatever-the-agent-says")  # the agent sees the name it asked for

    async def reached_as(model: str, expected: str) -> float:
        try:
            await vil.chat.completions.create(model=model, messages=ask, max_tokens=3)
            return 1.0
        except openai.APIStatusError as exc:  # a node without that adapter names what it was asked:
            # a pinned snapshot's 404 comes back as it is; a role's 404 (the node has not heard of
            # it yet) is retried by the gateway as infrastructure behind, then a 502 quoting it
            return 1.0 if f"'{expected}'" in str(exc) else 0.0

    vil_ok = await reached_as("anything", "villagers")
    pinned_ok = await reached_as("wolves@0", "wolves@0")
    return {"wolves": wolf_ok, "villagers": vil_ok * pinned_ok}
