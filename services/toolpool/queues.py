"""Queue names and the job serializer, shared by the pool, the client and the status view."""

from __future__ import annotations

from typing import Any

import redis

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


class _VersionFromHello(redis.Redis):
    """A client whose `INFO server` answer (the only section rq reads) comes from HELLO."""

    def info(self, section: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if section != "server":
            return super().info(section, *args, **kwargs)
        reply = self.execute_command("HELLO")
        fields = dict(zip(reply[::2], reply[1::2], strict=False)) if isinstance(reply, list) else dict(reply)
        version = fields.get(b"version", fields.get("version", b"0"))
        return {"redis_version": version.decode() if isinstance(version, bytes) else str(version)}


def rq_connection(r: redis.Redis) -> redis.Redis:
    """A client on `r`'s connection pool for rq to use.

    rq learns the server version from `INFO server` (BLMOVE over BLPOP, and a stamp on each
    job); INFO is refused to every squall ACL user (it shows the whole server), and rq would
    then assume Redis 5.0.9 and ask again on every dequeue. HELLO without a protocol version
    answers the same in RESP2 and is allowed, so this client answers `INFO server` from it.
    """
    return _VersionFromHello(connection_pool=r.connection_pool)
