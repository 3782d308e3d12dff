"""A spider-like SQL agent as a LangGraph graph: write -> execute -> check -> (rewrite -> execute
-> check)* -> done, on langchain-openai's ChatOpenAI (nothing squall-specific but the tool
calls, through squall.toolpool.client).

- write   (LLM, named agent `write`): a SELECT for the question, given the schema;
- execute (tool pool, `sql` queue): runs it read-only on the database, returns rows or the error;
- check   (LLM, named agent `check`): "is this result the answer?" — a yes ends the loop;
  an SQL error skips the question and goes straight to rewrite;
- rewrite (LLM, named agent `rewrite`): a corrected query, given the error or the doubt.

At most `MAX_REWRITES` rewrites. Each LLM node calls its own gateway URL
(`llm.agent_url(name)`), so the run config's `runner.train_agents = ["write", "rewrite"]`
trains only those two nodes; `check` turns are recorded but not trained. Reward (`reward`):
the pool's `sql` judge: 1.0 when the final query's result has the same rows as the gold
query's (order ignored), else 0.0.
"""

from __future__ import annotations

import re
from typing import Any, TypedDict

from squall.toolpool.client import ToolError, ajudge, arun_sql

MAX_REWRITES = 2
MAX_TOKENS = 128
DB = "default"  # the database name the pool serves (worker.databases)
TOOL_DEADLINE_S = 10.0
_FENCE = re.compile(r"```(?:sql)?\s*(.*?)```", re.S | re.I)


class State(TypedDict, total=False):
    question: str
    schema: str
    sql: str
    result: str
    error: str
    verdict: str
    rewrites: int


def extract_sql(text: str | None) -> str:
    """The query in a reply: the first fenced block, else the text from the first SELECT/WITH."""
    text = text or ""
    fenced = _FENCE.search(text)
    if fenced:
        text = fenced.group(1)
    start = re.search(r"\b(SELECT|WITH)\b", text, re.I)
    return (text[start.start() :] if start else text).strip().rstrip(";").strip()


async def reward(task: dict, sql: str) -> float:
    """The pool's `sql` judge on the final query against the gold one (0.0 for no query)."""
    if not sql:
        return 0.0
    verdict = await ajudge("sql", sql, task["gold_sql"], db=DB, deadline_s=TOOL_DEADLINE_S)
    return float(verdict["score"])


def build_graph(llm: Any) -> Any:
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    def model(name: str) -> Any:
        return ChatOpenAI(base_url=llm.agent_url(name), api_key=llm.api_key or "none", model=llm.model,
                          temperature=1.0, max_tokens=MAX_TOKENS, max_retries=0)  # fmt: skip

    writer, checker, rewriter = model("write"), model("check"), model("rewrite")

    async def write(state: State) -> State:
        prompt = f"Database schema:\n{state['schema']}\n\nWrite one SQLite SELECT query that answers: {state['question']}"
        reply = await writer.ainvoke(
            [("system", "You write SQL. Reply with the query only."), ("user", prompt)]
        )
        return {"sql": extract_sql(reply.content), "rewrites": 0}

    async def execute(state: State) -> State:
        try:
            out = await arun_sql(state["sql"] or "SELECT", db=DB, deadline_s=TOOL_DEADLINE_S)
        except ToolError as exc:
            return {"error": str(exc), "result": ""}
        rows = out["rows"][:10]
        return {
            "error": "",
            "result": f"columns {out['columns']}, rows {rows}" + (" ..." if out["truncated"] else ""),
        }

    async def check(state: State) -> State:
        if state.get("error"):
            return {"verdict": "error"}
        prompt = (f"Question: {state['question']}\nQuery: {state['sql']}\nResult: {state['result']}\n"
                  "Does the result answer the question? Reply yes or no.")  # fmt: skip
        reply = await checker.ainvoke([("user", prompt)])
        return {"verdict": "yes" if "yes" in str(reply.content).lower() else "no"}

    async def rewrite(state: State) -> State:
        problem = state.get("error") or f"the result {state.get('result')} may not answer the question"
        prompt = (f"Database schema:\n{state['schema']}\nQuestion: {state['question']}\n"
                  f"Query: {state['sql']}\nProblem: {problem}\nWrite a corrected SQLite SELECT query.")  # fmt: skip
        reply = await rewriter.ainvoke(
            [("system", "You fix SQL. Reply with the query only."), ("user", prompt)]
        )
        return {"sql": extract_sql(reply.content), "rewrites": state.get("rewrites", 0) + 1}

    def after_check(state: State) -> str:
        if state.get("verdict") == "yes" or state.get("rewrites", 0) >= MAX_REWRITES:
            return END
        return "rewrite"

    graph = StateGraph(State)
    for name, node in (("write", write), ("execute", execute), ("check", check), ("rewrite", rewrite)):
        graph.add_node(name, node)
    graph.add_edge(START, "write")
    graph.add_edge("write", "execute")
    graph.add_edge("execute", "check")
    graph.add_conditional_edges("check", after_check, ["rewrite", END])
    graph.add_edge("rewrite", "execute")
    return graph.compile()


async def agent(task: dict, llm: Any) -> float:
    state = await build_graph(llm).ainvoke({"question": task["question"], "schema": task["schema"]})
    return await reward(task, state.get("sql", ""))
