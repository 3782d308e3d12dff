"""The pool's tools for agent authors: one function per tool that enqueues an rq job and
waits for its result until a deadline.

    from squall.toolpool.client import run_code, search, run_sql, judge, ToolError

    out = run_code("print(6 * 7)")               # {"reason": "ok", "stdout": "42\\n", "text": "42", ...}
    hits = search("capital of Varnia", k=3)      # [{"id", "title", "text", "score"}, ...]
    rows = run_sql("SELECT count(*) FROM orders") # {"columns", "rows", "truncated"}
    score = judge("number", "it is 42", 42)       # {"score": 1.0, "detail": "number"}

Async agents use `arun_code`, `asearch`, `arun_sql`, `ajudge` (the same call on a thread of
the client's own pool). Every failure — bad arguments, an unknown tool, a job that failed or
timed out in the pool, no result by the deadline — raises ToolError with a sentence the agent
can hand its model as the tool's output. Nothing here needs the runner: the functions find
the pool from the environment (`Tools.from_env`): `SQUALL_TOOLS_URL` (the HTTP front,
services/toolpool/http.py) if set, else the run's Redis (`SQUALL_RUN__REDIS_URL`,
`SQUALL_RUN__NAME`, `SQUALL_WORKER__*`, or a run file in `SQUALL_CONFIG`).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from squall.shared.config import WorkerSection
from squall.shared.errors import ToolError
from squall.toolpool.queues import FUNCTIONS, check_tool, queue_name, rq_connection, serializer

BLOCK_SLICE_S = 1  # longest single blocking wait for a result (well under the client's socket timeout)
POLL_S = 0.05  # between looks for a result when less than a second is left, or a retry is pending
TTL_MARGIN_S = 10  # a queued job outlives its caller's deadline by this much, so the caller can cancel it
ASYNC_THREADS = 64  # threads for the async variants: one per tool call in flight


def failure_reason(exc_string: str | None) -> str:
    """The sentence an agent sees for a failed job (the last line of rq's traceback, cleaned)."""
    lines = [line.strip() for line in (exc_string or "").strip().splitlines() if line.strip()]
    if not lines:
        return "the job failed without a reason"
    last = lines[-1]
    if "AbandonedJobError" in last:
        return "the worker running this job died before it finished (AbandonedJobError)"
    name, sep, message = last.partition(": ")
    name = name.rsplit(".", 1)[-1]
    if name == "ToolError" and sep:
        return message
    if name == "JobTimeoutException":
        return f"the job ran past its time limit in the pool ({message})"
    return f"{name}: {message}" if sep else last


class Tools:
    """Calls on one run's pool through Redis (the agent-facing functions wrap a default one)."""

    def __init__(self, connection: Any, run: str, settings: WorkerSection | None = None) -> None:
        self.r = rq_connection(connection) if connection is not None else None
        self.run, self.settings = run, settings or WorkerSection()

    @classmethod
    def from_env(cls) -> Tools | HttpTools:
        if os.environ.get("SQUALL_TOOLS_URL"):
            return HttpTools(os.environ["SQUALL_TOOLS_URL"])
        from squall.shared.config import load_config
        from squall.shared.redisconn import connect

        config = load_config(os.environ.get("SQUALL_CONFIG") or None)
        return cls(connect(config.run.redis_url, autostart=False), config.run.name, config.worker)

    def call(self, tool: str, args: dict[str, Any], deadline_s: float | None = None) -> Any:
        """Enqueue `tool` with `args`; its result, or ToolError, within `deadline_s` seconds."""
        from rq import Queue, Retry

        check_tool(tool)
        if not isinstance(args, dict):
            raise ToolError(f"arguments of {tool!r} must be a JSON object, got {type(args).__name__}")
        deadline_s = self.settings.deadline_s if deadline_s is None else float(deadline_s)
        if not deadline_s > 0:
            raise ToolError(f"deadline_s must be > 0, got {deadline_s}")
        end = time.monotonic() + deadline_s
        s = self.settings
        queue = Queue(queue_name(self.run, tool), connection=self.r, serializer=serializer())
        try:
            job = queue.enqueue_call(
                FUNCTIONS[tool],
                kwargs=args,
                timeout=max(1, min(s.job_timeout_s, math.ceil(deadline_s))),
                result_ttl=s.result_ttl_s,
                failure_ttl=s.failure_ttl_s,
                ttl=math.ceil(deadline_s) + TTL_MARGIN_S,
                retry=Retry(max=s.retries) if s.retries else None,
            )
        except (TypeError, ValueError) as exc:
            raise ToolError(f"arguments of {tool!r} must be JSON values: {exc}") from None
        return self._wait(job, tool, end, deadline_s)

    def _wait(self, job: Any, tool: str, end: float, deadline_s: float) -> Any:
        """rq's result of `job` (Job.latest_result, which blocks in whole seconds) by `end`.

        A failed result while rq retries the job is not the answer: wait for a newer one."""
        from rq.job import JobStatus
        from rq.results import Result

        seen: str | None = None  # id of a failed result a retry will follow
        while (remaining := end - time.monotonic()) > 0:
            whole = min(BLOCK_SLICE_S, int(remaining))
            result = job.latest_result(timeout=whole) if whole >= 1 and seen is None else job.latest_result()
            if result is None or result.id == seen:
                if whole < 1 or seen is not None:
                    time.sleep(min(POLL_S, max(end - time.monotonic(), 0)))
                continue
            if result.type == Result.Type.SUCCESSFUL:
                return result.return_value
            retrying = job.get_status(refresh=True) in (
                JobStatus.QUEUED,
                JobStatus.STARTED,
                JobStatus.SCHEDULED,
            )
            if not retrying:
                raise ToolError(f"{tool}: {failure_reason(result.exc_string)}")
            seen = result.id
        status = self._give_up(job)
        if self._workers(tool) == 0:
            raise ToolError(
                f"{tool}: no result within the deadline of {deadline_s:g} s (job {status}): no worker "
                f"serves this tool: start `squall worker --queues {tool}`"
            )
        raise ToolError(
            f"{tool}: no result within the deadline of {deadline_s:g} s (job {status}); "
            "the pool may be busy: check `squall status` or `rq info`"
        )

    def _workers(self, tool: str) -> int:
        from rq import Queue, Worker

        try:
            return Worker.count(queue=Queue(queue_name(self.run, tool), connection=self.r))
        except Exception:  # only for the message: a failure here must not hide the deadline error
            return -1

    def _give_up(self, job: Any) -> str:
        """Cancel a job that has not started (nobody waits for it any more); its status."""
        from rq.job import JobStatus

        try:
            status = job.get_status(refresh=True)
            if status == JobStatus.QUEUED:
                job.cancel()
                return "cancelled before it started"
            return f"still {status.value}" if status is not None else "expired"
        except Exception as exc:  # the job may have expired meanwhile: the deadline error stands
            return f"unknown ({type(exc).__name__})"

    # --- one method per tool -------------------------------------------------------------
    def run_code(self, code: str, deadline_s: float | None = None) -> dict[str, Any]:
        return self.call("code", {"code": code}, deadline_s)

    def search(
        self, query: str, k: int = 3, corpus: str = "default", deadline_s: float | None = None
    ) -> list:
        return self.call("retrieval", {"query": query, "k": k, "corpus": corpus}, deadline_s)

    def run_sql(self, sql: str, db: str = "default", deadline_s: float | None = None) -> dict[str, Any]:
        return self.call("sql", {"sql": sql, "db": db}, deadline_s)

    def judge(
        self, kind: str, prediction: Any, reference: Any, db: str = "default", deadline_s: float | None = None
    ) -> dict[str, Any]:
        args = {"kind": kind, "prediction": prediction, "reference": reference, "db": db}
        return self.call("judge", args, deadline_s)


class HttpTools(Tools):
    """The same calls through the pool's HTTP front (for processes without Redis access)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(None, "", None)
        self.base_url = base_url.rstrip("/")

    def call(self, tool: str, args: dict[str, Any], deadline_s: float | None = None) -> Any:
        import httpx

        check_tool(tool)
        body: dict[str, Any] = {"args": args}
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        wait_s = (deadline_s or self.settings.deadline_s) + 5.0  # the server enforces the deadline
        try:
            response = httpx.post(f"{self.base_url}/v1/tools/{tool}", json=body, timeout=wait_s)
        except httpx.HTTPError as exc:
            raise ToolError(f"{tool}: the tool server at {self.base_url} did not answer: {exc}") from None
        data = (
            response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        )
        if response.status_code != 200:
            raise ToolError(str(data.get("error") or f"{tool}: HTTP {response.status_code}"))
        return data["result"]


_default: Tools | None = None
_default_lock = threading.Lock()
_executor = ThreadPoolExecutor(ASYNC_THREADS, thread_name_prefix="squall-tools")


def default_tools() -> Tools:
    """The process's Tools, from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Tools.from_env()
        return _default


def run_code(code: str, deadline_s: float | None = None) -> dict[str, Any]:
    """Run Python in the pool's sandbox: {"reason", "stdout", "stderr", "text", ...}."""
    return default_tools().run_code(code, deadline_s)


def search(query: str, k: int = 3, corpus: str = "default", deadline_s: float | None = None) -> list:
    """BM25 search of a corpus the pool serves: the k best {"id", "title", "text", "score"}."""
    return default_tools().search(query, k, corpus, deadline_s)


def run_sql(sql: str, db: str = "default", deadline_s: float | None = None) -> dict[str, Any]:
    """One read-only SQL query on a database the pool serves: {"columns", "rows", "truncated"}."""
    return default_tools().run_sql(sql, db, deadline_s)


def judge(
    kind: str, prediction: Any, reference: Any, db: str = "default", deadline_s: float | None = None
) -> dict[str, Any]:
    """Score a prediction with a judge of the pool (exact, contains, number, f1, sql)."""
    return default_tools().judge(kind, prediction, reference, db, deadline_s)


async def _threaded(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_executor, fn, *args)


async def arun_code(code: str, deadline_s: float | None = None) -> dict[str, Any]:
    return await _threaded(run_code, code, deadline_s)


async def asearch(query: str, k: int = 3, corpus: str = "default", deadline_s: float | None = None) -> list:
    return await _threaded(search, query, k, corpus, deadline_s)


async def arun_sql(sql: str, db: str = "default", deadline_s: float | None = None) -> dict[str, Any]:
    return await _threaded(run_sql, sql, db, deadline_s)


async def ajudge(
    kind: str, prediction: Any, reference: Any, db: str = "default", deadline_s: float | None = None
) -> dict[str, Any]:
    return await _threaded(judge, kind, prediction, reference, db, deadline_s)


__all__ = [
    "ToolError",
    "Tools",
    "HttpTools",
    "run_code",
    "search",
    "run_sql",
    "judge",
    "arun_code",
    "asearch",
    "arun_sql",
    "ajudge",
    "default_tools",
]
