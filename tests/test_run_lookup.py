"""`squall status` and `squall peek` find the run's Redis or say where they looked: a run that
does not exist is an error (exit 2) naming the run, each Redis and the runs it holds; without a
URL they also search the local Redis servers squall started (as `squall up` starts one on its
config's own port). Real Redis servers, the real commands as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import redis
from runner_helpers import SQUALL, TESTS_DIR

from squall.shared import bus, schemas
from squall.shared.keys import Keys
from squall.shared.localredis import REGISTRY_ENV, LocalRedis, free_port, recorded_servers

pytestmark = pytest.mark.redis


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A registry folder of this test's own, for the servers it starts and the commands it runs."""
    folder = tmp_path / "registry"
    monkeypatch.setenv(REGISTRY_ENV, str(folder))
    return folder


def squall(*args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR), **env}
    env.pop("SQUALL_RUN__REDIS_URL", None)
    return subprocess.run([*SQUALL, *args], capture_output=True, text=True, timeout=60, env=env)


def make_run(client, run: str) -> None:
    bus.publish(client, Keys(run).events, schemas.Event(run=run, service="runner", name="hello"))


def test_a_run_that_does_not_exist_is_an_error_naming_the_runs_there(r, redis_url, run_name):
    make_run(r, run_name)
    for command in (["status"], ["status", "--json"], ["peek", "events"]):
        done = squall(*command, "--run", "no-such-run", "--redis-url", redis_url)
        assert done.returncode == 2 and done.stdout == "", done
        assert (
            f"run 'no-such-run' not found: no key squall:no-such-run:* in\n  {redis_url} (--redis-url)"
            in done.stderr
        )
        assert f"runs there: {run_name}" in done.stderr and "Check the run name (--run)" in done.stderr
    found = squall("status", "--run", run_name, "--redis-url", redis_url, "--json")
    assert found.returncode == 0 and json.loads(found.stdout)["run"] == run_name


def test_a_run_file_pointing_elsewhere_is_searched_alone_and_named(
    r, redis_url, run_name, tmp_path, registry
):
    make_run(r, run_name)
    server = LocalRedis().start()  # recorded, but a config's URL is searched alone
    try:
        config = tmp_path / "run.toml"
        config.write_text(f'[run]\nname = "{run_name}"\nredis_url = "{server.url}"\n')
        done = squall("status", "--config", str(config))
    finally:
        server.close()
    assert done.returncode == 2
    assert (
        f"{server.url} (run.redis_url of {config} or SQUALL_RUN__REDIS_URL): runs there: none" in done.stderr
    )
    assert redis_url not in done.stderr


def test_without_a_url_the_run_is_found_in_a_local_redis_squall_started(run_name, registry):
    server = LocalRedis().start()
    client = redis.Redis.from_url(server.url)
    try:
        assert [s.url for s in recorded_servers()] == [server.url]
        make_run(client, run_name)
        status = squall("status", "--run", run_name)
        peek = squall("peek", "events", "--run", run_name)
    finally:
        client.close()
        server.close()
    note = f"run {run_name!r} found in {server.url}, a local Redis squall started: pid {server.process.pid}"
    assert status.returncode == 0 and status.stdout.startswith(f"run {run_name}\n"), status
    assert note in status.stderr
    assert peek.returncode == 0 and json.loads(peek.stdout)["name"] == "hello" and note in peek.stderr
    # the server is gone (as a `squall up`'s Redis is once it ends): its record with it
    assert recorded_servers() == [] and not list(registry.glob("*.json"))
    gone = squall("peek", "events", "--run", run_name)
    assert gone.returncode == 2 and f"run {run_name!r} not found" in gone.stderr
    assert "redis://127.0.0.1:6379/0 (the default run.redis_url)" in gone.stderr
    assert "--config RUN_FILE (its run.redis_url) or --redis-url URL" in gone.stderr
    assert "lives only as long as that `squall up`" in gone.stderr


def test_records_of_servers_that_are_gone_are_dropped(registry):
    registry.mkdir(parents=True)
    no_such_pid = 2**22 + 12345  # above Linux's largest pid
    stale = {"url": f"redis://127.0.0.1:{free_port()}/0", "pid": no_such_pid, "owner_pid": 1,
             "owner": "squall up", "started_at": 1.0}  # fmt: skip
    (registry / "1.json").write_text(json.dumps(stale))
    (registry / "2.json").write_text("not json")
    assert recorded_servers() == []
    assert not (registry / "1.json").exists()  # dropped; an unreadable record is left alone


def test_a_registry_others_may_write_to_is_not_trusted(registry):
    server = LocalRedis().start()
    try:
        assert [s.url for s in recorded_servers()] == [server.url]
        registry.chmod(0o777)  # in a shared temp dir, anyone could plant a record here
        assert recorded_servers() == []
        registry.chmod(0o700)
        assert [s.url for s in recorded_servers()] == [server.url]
    finally:
        server.close()
