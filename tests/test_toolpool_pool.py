"""The tool pool end to end: a real Redis, real `squall worker` processes (rq workers forking
work horses), real sandboxed subprocesses, the agent client and the HTTP front."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest
from rq import Queue, Worker
from rq.job import Job, JobStatus

from squall.shared.localredis import free_port
from squall.toolpool.client import ToolError, failure_reason
from squall.toolpool.queues import queue_name, serializer
from squall.toolpool.summary import format_summary, pool_summary
from tests.toolpool_helpers import running_pool
from tests.waiting import wait_for

pytestmark = pytest.mark.redis

RUN = f"pool{os.getpid()}"
CORPUS = [
    {"id": "d1", "title": "Varnia", "text": "The capital of Varnia is Oskelm, a port on the northern sea."},
    {"id": "d2", "title": "Oskelm", "text": "Oskelm was founded by the sailor Edda Brandt in 1412."},
    {"id": "d3", "title": "Quillon", "text": "Quillon is a mountain town known for copper mines."},
]


def _database(path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, total REAL)")
    conn.executemany(
        "INSERT INTO orders VALUES (?, ?, ?)", [(1, "ana", 10.5), (2, "ben", 20.0), (3, "ana", 4.5)]
    )
    conn.commit()
    conn.close()


def _settings(tmp) -> dict[str, str]:
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    _database(tmp / "shop.db")
    return {
        "SQUALL_WORKER__QUEUES": '["code", "retrieval", "sql", "judge"]',
        "SQUALL_WORKER__CORPORA": json.dumps({"default": str(corpus)}),
        "SQUALL_WORKER__DATABASES": json.dumps({"default": str(tmp / "shop.db")}),
        "SQUALL_WORKER__CODE_CPU_S": "1",
        "SQUALL_WORKER__CODE_WALL_S": "3",
        "SQUALL_WORKER__CODE_OUTPUT_BYTES": "4096",
        "SQUALL_WORKER__SQL_TIMEOUT_S": "1",
        "SQUALL_WORKER__MAINTENANCE_S": "1",
        "SQUALL_WORKER__HEARTBEAT_S": "1",
    }


@pytest.fixture(scope="module")
def pool(redis_url, tmp_path_factory):
    """`squall worker --workers 1 --http-port P` for run RUN; yields what tests need."""
    tmp = tmp_path_factory.mktemp("pool")
    port = free_port()
    with running_pool(
        redis_url, RUN, _settings(tmp), tmp / "worker.log", ("--workers", "1", "--http-port", str(port))
    ) as p:
        wait_for(lambda: _http_up(port), 30, "the tools' HTTP front")
        yield {**p, "port": port}


def _http_up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _worker_pids(r) -> set[int]:
    return {w.pid for w in Worker.all(connection=r) if queue_name(RUN, "code") in w.queue_names()}


# --- the four tools --------------------------------------------------------------------------


def test_each_tool_answers(pool):
    tools = pool["tools"]
    out = tools.run_code("print(sum(i * i for i in range(10)))", deadline_s=20)
    assert out["reason"] == "ok" and out["text"] == "285"
    hits = tools.search("capital of Varnia", k=2, deadline_s=20)
    assert hits[0]["id"] == "d1" and "Oskelm" in hits[0]["text"] and hits[0]["score"] > 0
    rows = tools.run_sql("SELECT customer, sum(total) FROM orders GROUP BY customer ORDER BY customer")
    assert rows == {
        "columns": ["customer", "sum(total)"],
        "rows": [["ana", 15.0], ["ben", 20.0]],
        "truncated": False,
    }
    assert tools.judge("number", "so it is 42.", 42)["score"] == 1.0
    assert tools.judge("exact", "The Oskelm", "oskelm")["score"] == 1.0
    good = "SELECT total FROM orders WHERE customer = 'ana'"
    assert tools.judge("sql", "SELECT total FROM orders WHERE id IN (1, 3)", good)["score"] == 1.0
    assert tools.judge("sql", "SELECT total FROM orders", good)["score"] == 0.0
    broken = tools.judge("sql", "SELECT nope FROM orders", good)
    assert broken["score"] == 0.0 and "no such column" in broken["detail"]


def test_sandbox_escapes_through_the_pool_leave_the_worker_alive(pool):
    tools, pids = pool["tools"], _worker_pids(pool["r"])
    cases = {
        "while True: pass": "cpu_time",
        "x = bytearray(2 * 1024**3)": "memory",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass": ("cpu_time", "wall_time", "processes"),
        "open('/tmp/squall-pool-escape', 'w').write('x')": "error",
        "import os\nprint(os.environ.get('SQUALL_RUN__REDIS_URL'))": "ok",
        "import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=1)": "error",
        "print('x' * 100_000_000)": "output_limit",
        "import time\ntime.sleep(30)": "wall_time",
    }  # fmt: skip
    for code, expected in cases.items():
        out = tools.run_code(code, deadline_s=20)
        assert out["reason"] in (expected if isinstance(expected, tuple) else (expected,)), (code, out)
        assert out["reason"] == "ok" or "[sandbox: " in out["text"]
    assert not os.path.exists("/tmp/squall-pool-escape")
    assert tools.run_code("import os\nprint(os.environ.get('SQUALL_RUN__REDIS_URL'))")["stdout"] == "None\n"
    assert tools.run_code("print(1)")["stdout"] == "1\n"
    assert _worker_pids(pool["r"]) == pids  # the same worker process served all of it


# --- bad input -------------------------------------------------------------------------------


def test_bad_input_gives_clear_errors_and_nothing_stops(pool):
    tools = pool["tools"]
    expectations = [
        (lambda: tools.run_code(123), "argument 'code' must be a non-empty string"),
        (
            lambda: tools.call("code", {"code": "print(1)", "shell": True}),
            "unexpected keyword argument 'shell'",
        ),
        (lambda: tools.search("x", k="many"), "argument 'k' must be an integer"),
        (lambda: tools.search("x", corpus="web"), "unknown corpus 'web'"),
        (lambda: tools.judge("vibes", "a", "b"), "unknown judge 'vibes'"),
        (lambda: tools.call("shell", {"cmd": "ls"}), "unknown tool 'shell'"),
        (lambda: tools.call("code", ["print(1)"]), "must be a JSON object"),
        (lambda: tools.call("code", {"code": object()}), "must be JSON values"),
        (lambda: tools.run_sql("DELETE FROM orders"), "not authorized"),
        (lambda: tools.run_sql("ATTACH DATABASE '/tmp/x.db' AS x"), "not authorized"),
        (lambda: tools.run_sql("SELECT 1; SELECT 2"), "one statement at a time"),
        (lambda: tools.run_sql("SELEC 1"), "syntax error"),
    ]
    for call, message in expectations:
        with pytest.raises(ToolError, match=message):
            call()
    assert tools.run_sql("SELECT count(*) FROM orders")["rows"] == [[3]]  # nothing was deleted


def test_sql_that_never_ends_is_stopped(pool):
    started = time.monotonic()
    with pytest.raises(ToolError, match="ran longer than 1 s and was stopped"):
        pool["tools"].run_sql(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
        )
    assert time.monotonic() - started < 5
    assert pool["tools"].run_sql("SELECT 1")["rows"] == [[1]]


def test_a_job_naming_an_unknown_function_fails_with_a_reason(pool):
    r = pool["r"]
    job = Queue(queue_name(RUN, "code"), connection=r, serializer=serializer()).enqueue_call(
        "squall.toolpool.jobs.format_disk", kwargs={}
    )
    wait_for(lambda: job.get_status(refresh=True) == JobStatus.FAILED, 20, "the job to fail")
    assert "format_disk" in failure_reason(job.latest_result().exc_string)
    assert pool["tools"].run_code("print(2)")["stdout"] == "2\n"


def test_a_pickled_job_is_not_run(pool):
    """Jobs are JSON: a pickle payload written into the queue fails to decode instead of running."""
    r = pool["r"]
    marker = "/tmp/squall-pickle-ran"
    job = Queue(queue_name(RUN, "code"), connection=r).enqueue_call(os.system, args=(f"touch {marker}",))
    wait_for(lambda: job.get_status(refresh=True) in (JobStatus.FAILED, None), 20, "the pickled job to fail")
    assert not os.path.exists(marker)
    assert pool["tools"].run_code("print(3)")["stdout"] == "3\n"


# --- deadlines and dead workers --------------------------------------------------------------


def test_the_wait_ends_at_the_deadline(pool):
    started = time.monotonic()
    with pytest.raises(ToolError, match="no result within the deadline of 0.5 s"):
        pool["tools"].run_code("import time\ntime.sleep(2)", deadline_s=0.5)
    assert time.monotonic() - started < 1.5


@pytest.mark.slow
def test_worker_killed_mid_job_fails_the_job_and_the_agent_wait_ends(pool):
    r, tools = pool["r"], pool["tools"]
    before = _worker_pids(r)
    errors: list[str] = []
    started = time.monotonic()

    def agent() -> None:
        try:
            tools.run_code("import time\nprint('started', flush=True)\ntime.sleep(60)", deadline_s=4)
        except ToolError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=agent)
    thread.start()
    queue = Queue(queue_name(RUN, "code"), connection=r, serializer=serializer())
    job_id = wait_for(lambda: queue.started_job_registry.get_job_ids(), 10, "the job to start")[0]
    (pid,) = before
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=10)
    # the agent hears of it by its deadline at the latest: the failure, or the deadline passing
    assert not thread.is_alive() and errors, errors
    assert "worker running this job died" in errors[0] or "deadline of 4 s" in errors[0], errors
    assert time.monotonic() - started < 7
    job = Job.fetch(job_id, connection=r, serializer=serializer())
    wait_for(lambda: job.get_status(refresh=True) == JobStatus.FAILED, 30, "the abandoned job to be failed")
    assert "worker running this job died" in failure_reason(job.latest_result().exc_string)
    # the supervisor started a new worker; no sandboxed process outlived the horse
    wait_for(lambda: _worker_pids(r) - before, 30, "a restarted worker")
    assert tools.run_code("print(4)", deadline_s=20)["stdout"] == "4\n"


# --- HTTP, status, rq info ---------------------------------------------------------------------


def test_http_front(pool):
    base = f"http://127.0.0.1:{pool['port']}/v1/tools"
    ok = httpx.post(f"{base}/code", json={"args": {"code": "print(7 * 6)"}, "deadline_s": 20}, timeout=30)
    assert ok.status_code == 200 and ok.json()["result"]["text"] == "42", ok.text
    assert httpx.post(f"{base}/shell", json={"args": {}}, timeout=5).status_code == 404
    assert httpx.post(f"{base}/code", content=b"{not json", timeout=5).status_code == 400
    assert httpx.post(f"{base}/code", json={"args": {}, "deadline_s": -1}, timeout=5).status_code == 400
    bad = httpx.post(
        f"{base}/judge", json={"args": {"kind": "vibes", "prediction": 1, "reference": 1}}, timeout=30
    )
    assert bad.status_code == 422 and "unknown judge" in bad.json()["error"]
    assert httpx.get(base, timeout=5).json() == {"tools": ["code", "retrieval", "sql", "judge"]}


def test_http_client_for_agents_without_redis(pool, monkeypatch):
    from squall.toolpool.client import HttpTools

    tools = HttpTools(f"http://127.0.0.1:{pool['port']}")
    assert tools.search("who founded Oskelm", k=1)[0]["id"] == "d2"
    with pytest.raises(ToolError, match="unknown corpus"):
        tools.search("x", corpus="web")


def test_pool_summary_and_rq_info(pool, redis_url):
    summary = pool_summary(pool["r"], RUN)
    assert set(summary["queues"]) == {"code", "retrieval", "sql", "judge"}
    assert summary["queues"]["code"]["workers"] >= 1 and summary["queues"]["code"]["finished"] >= 1
    assert summary["workers"] and summary["workers"][0]["queues"] == ["code", "retrieval", "sql", "judge"]
    assert "tool pool:" in format_summary(summary)
    info = subprocess.run([os.path.join(os.path.dirname(sys.executable), "rq"), "info", "--url", redis_url],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert info.returncode == 0 and queue_name(RUN, "code") in info.stdout


def test_status_and_dashboard_show_the_pool(pool):
    from squall.monitor.snapshot_json import snapshot
    from squall.monitor.status import collect, render
    from squall.shared.keys import Keys

    status = collect(pool["r"], RUN)
    assert status["tools"]["queues"]["code"]["workers"] >= 1
    assert "tool pool:" in render(status) and "code" in render(status)
    page = snapshot(pool["r"], Keys(RUN))
    assert page["tools"]["queues"].keys() == status["tools"]["queues"].keys()
    assert page["tools"]["queues"]["code"]["finished"] >= 1


def test_toolpool_is_the_command_and_worker_its_older_name():
    from squall.cli import COMMANDS

    assert COMMANDS["toolpool"][0] == COMMANDS["worker"][0] == "squall.toolpool.cli"
    for name in ("toolpool", "worker"):
        shown = subprocess.run([sys.executable, "-m", "squall.cli", name, "--help"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (
            shown.returncode == 0 and f"usage: squall {name}" in shown.stdout and "--workers" in shown.stdout
        )
