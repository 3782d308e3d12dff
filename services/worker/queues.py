"""Queue names and the job serializer, shared by the pool, the client and the status view."""

from __future__ import annotations

from squall.shared.errors import ToolError
from squall.shared.keys import Keys

TOOLS = ("code", "retrieval", "sql", "judge")  # one rq queue per tool; WorkerSection.queues picks
FUNCTIONS = {  # tool -> import path of the function rq runs for it (jobs.py)
    "code": "squall.worker.jobs.run_code",
    "retrieval": "squall.worker.jobs.search",
    "sql": "squall.worker.jobs.run_sql",
    "judge": "squall.worker.jobs.judge",
}
PING = "squall.worker.jobs.ping"  # the trivial job (benchmarks)


def check_tool(tool: str) -> str:
    if tool not in TOOLS:
        raise ToolError(f"unknown tool {tool!r}: the pool's tools are {list(TOOLS)}")
    return tool


def queue_name(run: str, tool: str) -> str:
    """`squall:{run}:tools:{tool}`; rq keeps the queue under `rq:queue:<name>`."""
    return Keys(run).tool_queue(check_tool(tool))


def serializer() -> type:
    """JSON, never pickle: a job read from Redis must not be able to run code when decoded."""
    from rq.serializers import JSONSerializer

    return JSONSerializer
