"""The tool pool under `squall acl`: a real redis-server loaded with the generated ACL file, a
real `squall worker` logged in as `squall-worker`, an agent's client as `squall-runner`, the
status view as `squall-monitor`; what they must not do is refused."""

from __future__ import annotations

import subprocess
import time

import pytest
import redis

from squall.monitor import acl
from squall.shared.localredis import find_server_binary, free_port
from squall.toolpool.client import ToolError, Tools
from squall.toolpool.summary import pool_summary
from tests.toolpool_helpers import running_pool

pytestmark = pytest.mark.redis
RUN = "acltools"


def _url(path) -> str:
    lines = dict(
        line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")
    )
    return lines["SQUALL_RUN__REDIS_URL"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("acl")
    port = free_port()
    acl.write_acl(out, RUN, port=port)
    process = subprocess.Popen([find_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(out), "--aclfile", str(out / acl.ACL_FILE)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    urls = {name: _url(out / f"{name}.env") for name in (*acl.SERVICES, acl.ADMIN_USER)}
    admin = redis.Redis.from_url(urls["admin"])
    end = time.monotonic() + 10
    while True:
        try:
            admin.ping()
            break
        except redis.ConnectionError:
            assert process.poll() is None and time.monotonic() < end, process.stdout.read()
            time.sleep(0.05)
    yield {"urls": urls, "out": out}
    process.terminate()
    process.wait(timeout=10)


def test_pool_works_with_least_privilege_users(server, tmp_path):
    urls = server["urls"]
    settings = {"SQUALL_WORKER__QUEUES": '["code", "judge"]'}
    with running_pool(urls["worker"], RUN, settings, tmp_path / "worker.log") as pool:
        agent = Tools(redis.Redis.from_url(urls["runner"]), RUN, pool["tools"].settings)
        assert agent.run_code("print(5)", deadline_s=20)["stdout"] == "5\n"
        with pytest.raises(ToolError, match="unknown judge"):
            agent.judge("vibes", 1, 1, deadline_s=20)
        with pytest.raises(ToolError, match="deadline"):
            agent.run_code("import time\ntime.sleep(3)", deadline_s=0.5)
        summary = pool_summary(redis.Redis.from_url(urls["monitor"]), RUN)
        assert summary["queues"]["code"]["workers"] == 1 and summary["queues"]["judge"]["failed"] == 1
        assert "unknown judge" in summary["failures"][0]["reason"]
    log = (tmp_path / "worker.log").read_text()
    assert "NOPERM" not in log and "no permissions" not in log, log[-2000:]


def test_what_each_user_may_not_do(server):
    urls = server["urls"]
    worker, monitor = redis.Redis.from_url(urls["worker"]), redis.Redis.from_url(urls["monitor"])
    for call in (lambda: worker.xadd(f"squall:{RUN}:tasks", {"m": b"x"}),
                 lambda: worker.hget(f"squall:{RUN}:config", "json"),
                 lambda: worker.set("other:key", 1),
                 lambda: monitor.rpush("rq:queue:squall:acltools:tools:code", "x"),
                 lambda: monitor.hset("rq:job:x", "status", "finished")):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    runner = redis.Redis.from_url(urls["runner"]).pubsub()
    with pytest.raises(redis.exceptions.NoPermissionError):  # only workers listen on rq's channels
        runner.subscribe("rq:pubsub:someworker")
        runner.get_message(timeout=2)
