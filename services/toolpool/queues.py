"""Queue names and the job serializer, shared by the pool, the client and the status view."""

from __future__ import annotations

from typing import Any

from squall.shared.errors import ToolError
from squall.shared.keys import Keys

TOOLS = ("code", "retrieval", "sql", "judge")  # one rq queue per tool; WorkerSection.queues picks
FUNCTIONS = {  # tool -> import path of the function rq runs for it (jobs.py)
    "code": "squall.toolpool.jobs.run_code",
    "retrieval": "squall.toolpool.jobs.search",
    "sql": "squall.toolpool.jobs.run_sql",
    "judge": "squall.toolpool.jobs.judge",
}
PING = "squall.toolpool.jobs.ping"  # the trivial job (benchmarks)


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


def tell_rq_the_server_version(r: Any) -> Any:
    """Cache the server version on `r` the way rq does, from HELLO instead of INFO.

    rq asks INFO once per connection (to pick BLMOVE over BLPOP, and to stamp jobs); INFO is
    refused to every squall ACL user (it shows the whole server), and rq would then assume
    Redis 5.0.9. HELLO without a protocol version answers the same in RESP2 and is allowed.
    """
    reply = r.execute_command("HELLO")
    fields = dict(zip(reply[::2], reply[1::2], strict=False)) if isinstance(reply, list) else dict(reply)
    version = fields.get(b"version", fields.get("version", b"0"))
    parts = [
        int(p) for p in (version.decode() if isinstance(version, bytes) else str(version)).split(".")[:3]
    ]
    setattr(r, "__rq_redis_server_version", tuple((parts + [0, 0, 0])[:3]))
    return r
