"""`pool_summary(r, run)`: the tool pool at a glance, for `squall status` and the dashboard.

    {"queues": {"code": {"queued": 0, "started": 1, "finished": 40, "failed": 2, "workers": 2}, ...},
     "workers": [{"name", "state", "queues", "current_job", "successful", "failed", "pid", "host"}],
     "failures": [{"tool", "job", "reason", "ended_at"}]}   # the newest few, newest first

Read-only (rq's own keys: queues, registries, worker hashes; works as the `squall-monitor`
ACL user), safe to poll every second.
"""

from __future__ import annotations

from typing import Any

from squall.toolpool.client import failure_reason
from squall.toolpool.queues import TOOLS, queue_name, serializer

RECENT_FAILURES = 5  # failed jobs listed per queue


def pool_summary(r: Any, run: str, tools: tuple[str, ...] = TOOLS) -> dict[str, Any]:
    from rq import Queue, Worker
    from rq.exceptions import NoSuchJobError
    from rq.job import Job

    queues: dict[str, Any] = {}
    failures: list[dict[str, Any]] = []
    by_queue = {queue_name(run, t): t for t in tools}
    for tool in tools:
        q = Queue(queue_name(run, tool), connection=r, serializer=serializer())
        # Plain reads of rq's keys: rq's own counters clean expired entries first (writes), and
        # this view must work for the read-only monitor user.
        queues[tool] = {
            "queued": r.llen(q.key),
            "started": r.zcard(q.started_job_registry.key),
            "finished": r.zcard(q.finished_job_registry.key),
            "failed": r.zcard(q.failed_job_registry.key),
            "workers": Worker.count(queue=q),
        }
        failed_ids = [i.decode() for i in r.zrange(q.failed_job_registry.key, -RECENT_FAILURES, -1)]
        for job_id in failed_ids:
            try:  # one by one: fetch_many uses MULTI, which the read-only monitor user may not
                job = Job.fetch(job_id, connection=r, serializer=serializer())
            except NoSuchJobError:
                continue
            if job is not None:
                result = job.latest_result()
                failures.append(
                    {
                        "tool": tool,
                        "job": job.id,
                        "ended_at": str(job.ended_at or ""),
                        "reason": failure_reason(result.exc_string if result else None),
                    }
                )
    workers = []
    for w in Worker.all(connection=r, serializer=serializer()):
        names = [q.name for q in w.queues]
        if not any(n in by_queue for n in names):
            continue
        running = sorted(
            m.decode().split(":")[0] for m in r.smembers(w.executions_key)
        )  # job_id:execution_id
        workers.append(
            {
                "name": w.name,
                "state": str(w.get_state()),
                "pid": w.pid,
                "host": w.hostname,
                "queues": [by_queue.get(n, n) for n in names],
                "current_job": running[0] if running else None,
                "successful": w.successful_job_count,
                "failed": w.failed_job_count,
            }
        )
    failures.sort(key=lambda f: f["ended_at"], reverse=True)
    return {"queues": queues, "workers": workers, "failures": failures[:RECENT_FAILURES]}


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines of text for `squall status`."""
    lines = ["tool pool:"]
    for tool, q in summary["queues"].items():
        lines.append(
            f"  {tool:<10} queued={q['queued']} started={q['started']} finished={q['finished']} "
            f"failed={q['failed']} workers={q['workers']}"
        )
    for f in summary["failures"]:
        lines.append(f"  failed {f['tool']} job {f['job']}: {f['reason']}")
    return "\n".join(lines)
