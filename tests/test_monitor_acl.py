"""`squall acl` against a real redis-server started with the generated --aclfile.

Each service user does what its service does, through the same shared/ code (GroupConsumer
read/renew/reclaim/ack, publish, dead_letter, Ledger, trim_acknowledged); each forbidden
operation is refused with NOPERM; `default` is off; passwords only in the 0600 env files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from squall.monitor import acl
from squall.monitor.snapshot_json import snapshot
from squall.monitor.stalls import Thresholds, detect
from squall.shared import bus, dataend, resources, schemas
from squall.shared.heartbeat import read_heartbeats
from squall.shared.keys import GROUP_RUNNERS, GROUP_SCHEDULER, GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import find_server_binary, free_port
from squall.shared.redisconn import connect, redact
from squall.shared.runlookup import has_run, runs_in
from squall.shared.runwarnings import RunWarning, record_once

pytestmark = pytest.mark.redis

RUN = "acltest"
OTHER_RUN = "otherrun"
K = Keys(RUN)


def _env(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    """A redis-server of our own, loaded with the ACL file `squall acl` wrote."""
    out = tmp_path_factory.mktemp("acl")
    port = free_port()
    code = subprocess.run(
        [sys.executable, "-m", "squall.cli", "acl", "--run", RUN, "--out", str(out), "--port", str(port),
         "--password", "monitor=given password/with:odd@chars"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert code.returncode == 0, code.stderr
    process = subprocess.Popen(
        [find_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(out), "--aclfile", str(out / acl.ACL_FILE)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    urls = {
        name: _env(out / f"{name}.env")["SQUALL_RUN__REDIS_URL"] for name in (*acl.SERVICES, acl.ADMIN_USER)
    }
    admin = redis.Redis.from_url(urls["admin"])
    deadline = time.monotonic() + 10
    while True:
        try:
            admin.ping()
            break
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise AssertionError(
                    f"redis with the ACL file did not start: {process.stdout.read()!r}"
                ) from None
            time.sleep(0.05)
    yield {"out": out, "port": port, "urls": urls, "admin": admin}
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def users(acl_server):
    """name -> a client logged in as that service user; the database flushed (as admin)."""
    acl_server["admin"].flushdb()
    clients = {name: redis.Redis.from_url(url) for name, url in acl_server["urls"].items()}
    yield clients
    for client in clients.values():
        client.close()


def refused(call, *args, **kwargs) -> bool:
    try:
        call(*args, **kwargs)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.ResponseError as exc:  # NOPERM on a command inside a script comes back as a script error
        return any(text in str(exc) for text in ("NOPERM", "no permissions", "can't access"))
    return False


def _task(index: int, attempt: int = 0) -> schemas.Task:
    return schemas.Task(run=RUN, task_id=f"g0:{index}", group_id="g0", sample_id="s0", index=index, group_size=4,
                        attempt=attempt, payload={"q": index}, deadline=time.time() + 60)  # fmt: skip


def _trajectory(task: schemas.Task) -> schemas.Trajectory:
    return schemas.Trajectory(run=RUN, task_id=task.task_id, group_id=task.group_id, sample_id=task.sample_id,
                              index=task.index, group_size=4, attempt=task.attempt, runner_id="runner-1:0",
                              status="ok", reward=1.0)  # fmt: skip


def _scheduler_dispatches(r: redis.Redis, n: int = 4) -> list[schemas.Task]:
    """What the scheduler does: groups on its streams, tasks in one MULTI with the ledger move."""
    for stream in (K.tasks, K.trajectories):
        for group in K.groups_of(stream):
            bus.ensure_group(r, stream, group)
    tasks = [_task(i) for i in range(n)]
    ledger = Ledger(r, K)
    pipe = r.pipeline(transaction=True)
    for task in tasks:
        pipe.xadd(K.tasks, {schemas.ENTRY_FIELD: schemas.encode(task)})
    ledger.move_in(pipe, [t.key for t in tasks], "pending", allowed_from=["new"])
    pipe.execute()
    return tasks


# --- files ---------------------------------------------------------------------------------


def test_files_are_private_and_hold_no_clear_password_in_the_acl(acl_server):
    out = acl_server["out"]
    text = (out / acl.ACL_FILE).read_text()
    for name in (*acl.SERVICES, acl.ADMIN_USER):
        path = out / f"{name}.env"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        password = redis.connection.parse_url(acl_server["urls"][name])["password"]
        assert len(password) >= 20 and password not in text
        assert acl.password_hash(password) in text
    assert stat.S_IMODE((out / acl.ACL_FILE).stat().st_mode) == 0o600
    assert (
        redis.connection.parse_url(acl_server["urls"]["monitor"])["password"]
        == "given password/with:odd@chars"
    )
    assert all(line.startswith("user ") for line in text.splitlines())  # an ACL file takes no comments


def test_env_file_url_connects_and_redacts(acl_server):
    url = acl_server["urls"]["runner"]
    password = redis.connection.parse_url(url)["password"]
    assert password not in redact(url) and "***" in redact(url)
    r = connect(url, deadline_s=2)
    assert r.ping()


def test_default_user_is_off(acl_server):
    no_retry = Retry(NoBackoff(), 0)  # redis-py retries failed logins with backoff otherwise
    for login in (
        {},
        {"username": "default", "password": ""},
        {"username": "squall-runner", "password": "wrong"},
    ):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=acl_server["port"], retry=no_retry, **login).ping()


# --- what each service needs works -----------------------------------------------------------


def test_scheduler_can_do_its_job(users):
    r = users["scheduler"]
    tasks = _scheduler_dispatches(r)
    ledger = Ledger(r, K)
    assert ledger.counts() == {"pending": 4, "dispatched": 4}
    r.hset(K.groups, "g0", "{}")
    r.hset(K.scheduler_state, mapping={"epoch": 0, "position": 4})
    r.hset(K.heartbeats, "scheduler:0", '{"time": 1}')
    r.xadd(K.rewards, {"version": 0, "mode": "train", "mean": 0.5, "count": 4, "group_id": "g0", "time": 1.0})
    bus.publish(r, K.events, schemas.Event(run=RUN, service="scheduler", name="started"))
    users["admin"].xadd(K.control, {"m": schemas.encode(schemas.Control(run=RUN, action="pause"))})
    assert r.xread({K.control: "0"}, count=10)
    assert r.hget(K.versions, "trainer") is None and r.xrevrange(K.weights_applied, count=1) == []
    # its group of trajectories, acked, then both streams trimmed past what every group acked
    for task in tasks:
        bus.publish(users["runner"], K.trajectories, _trajectory(task))
    consumer = bus.GroupConsumer(r, K.trajectories, GROUP_SCHEDULER, "scheduler-0", kind=schemas.Trajectory,
                                 deadletter_stream=K.deadletter)  # fmt: skip
    got = consumer.read(10, block_ms=100)
    assert len(got) == 4 and consumer.ack([d.entry_id for d in got]) == 4
    assert ledger.move([t.key for t in tasks], "cancelled") == 4
    assert bus.trim_acknowledged(r, K.tasks, K.groups_of(K.tasks)) == 0  # runners have not acked
    assert r.xinfo_groups(K.tasks)[0]["lag"] == 4
    bus.dead_letter(r, K.deadletter, source=K.tasks, entry_id="1-0", reason="test", raw=b"x")
    # the end-of-data handshake: announce, settle without an answer, clear on a resume
    assert dataend.announce_data_end(r, K, samples=4) and not dataend.announce_data_end(r, K, samples=4)
    dataend.settle_unconfirmed(r, K, 0)
    assert dataend.read(r, K).end_version == 0 and read_heartbeats(r, K)
    dataend.clear(r, K)


def test_runner_can_do_its_job(users):
    _scheduler_dispatches(users["scheduler"])
    users["scheduler"].xadd(K.tasks, {"m": b"not msgpack"})  # a malformed task: the runner dead-letters it
    r = users["runner"]
    a = bus.GroupConsumer(
        r, K.tasks, GROUP_RUNNERS, "runner-a:0", kind=schemas.Task, deadletter_stream=K.deadletter
    )
    b = bus.GroupConsumer(
        r, K.tasks, GROUP_RUNNERS, "runner-b:0", kind=schemas.Task, deadletter_stream=K.deadletter
    )
    mine = a.read(10, block_ms=100)
    assert len(mine) == 4 and a.dead_lettered == 1
    assert a.read(10, own_pending=True)  # a restarted runner re-reads its own pending entries
    assert a.renew([d.entry_id for d in mine[:2]]) == [d.entry_id for d in mine[:2]]  # the renew Lua script
    time.sleep(0.06)
    taken = b.reclaim(min_idle_ms=50)  # XAUTOCLAIM + XPENDING ranges
    assert {d.entry_id for d in taken} == {d.entry_id for d in mine}
    assert taken[0].deliveries >= 2  # read, re-read as own pending, reclaimed
    r.xclaim(K.tasks, GROUP_RUNNERS, "runner-a:0", 0, [taken[0].entry_id])  # plain XCLAIM works too
    for delivery in taken:
        bus.publish(r, K.trajectories, _trajectory(delivery.message))
    assert b.ack([d.entry_id for d in taken]) == 4
    ledger = Ledger(r, K)  # runner.py moves its attempts pending -> running itself
    assert ledger.state_of(taken[0].message.key) == "pending"
    assert ledger.move([taken[0].message.key], "running", allowed_from=("pending",)) == 1
    r.hset(K.heartbeats, "runner:a", '{"time": 1}')
    r.hdel(K.heartbeats, "runner:a")
    r.hget(K.versions, "trainer")
    r.xrevrange(K.control, count=1)
    assert record_once(r, K, RunWarning("train_agent_unused", "solver", "no call", 1.0, "runner:a"))
    bus.publish(r, K.events, schemas.Event(run=RUN, service="runner", name="stopped"))
    assert users["admin"].xlen(K.trajectories) == 4


def test_runner_finish_script_works(users):
    """runner.py publishes a trajectory, acks its task and moves the ledger in one script."""
    from squall.runner import runner as runner_module

    _scheduler_dispatches(users["scheduler"], n=2)
    r = users["runner"]
    consumer = bus.GroupConsumer(r, K.tasks, GROUP_RUNNERS, "runner-a:0", kind=schemas.Task,
                                 deadletter_stream=K.deadletter)  # fmt: skip
    delivery, other = consumer.read(2, block_ms=100)
    Ledger(r, K).move([delivery.message.key], "running", allowed_from=("pending",))
    finish = r.register_script(runner_module._FINISH)
    published = finish(
        keys=[K.tasks, K.trajectories, K.attempts, K.ledger],
        args=[GROUP_RUNNERS, "runner-a:0", delivery.entry_id, schemas.encode(_trajectory(delivery.message)),
              delivery.message.key, "ok"],
    )  # fmt: skip
    assert published == 1
    assert users["admin"].xlen(K.trajectories) == 1 and Ledger(users["admin"], K).counts()["ok"] == 1
    assert users["admin"].xpending(K.tasks, GROUP_RUNNERS)["pending"] == 1
    # the same script cannot be turned against `tasks`: its XADD there is refused inside it
    assert refused(finish, keys=[K.tasks, K.tasks, K.attempts, K.ledger],
                   args=[GROUP_RUNNERS, "runner-a:0", other.entry_id, b"x", "k", "ok"])  # fmt: skip
    assert users["admin"].xlen(K.tasks) == 2


def test_trainer_can_do_its_job(users):
    tasks = _scheduler_dispatches(users["scheduler"])
    for task in tasks:
        bus.publish(users["runner"], K.trajectories, _trajectory(task))
    r = users["trainer"]
    consumer = bus.GroupConsumer(r, K.trajectories, GROUP_TRAINER, "trainer-0", kind=schemas.Trajectory,
                                 deadletter_stream=K.deadletter)  # fmt: skip
    got = consumer.read(10, block_ms=100)
    assert len(got) == 4
    consumer.renew([got[0].entry_id])
    assert consumer.reclaim(min_idle_ms=60_000) == []
    ledger = Ledger(r, K)
    assert ledger.move([d.message.key for d in got[:3]], "trained") == 3
    assert ledger.filtered([got[3].message.key], "zero_variance") == 1
    assert ledger.state_of(got[0].message.key) == "trained" and ledger.balanced()
    consumer.ack([d.entry_id for d in got])
    bus.publish(r, K.weights, schemas.WeightVersion(run=RUN, version=1, step=1, location="/w", checksum="ab"))
    bus.publish(r, K.metrics, schemas.Metrics(run=RUN, step=1, version=1, values={"loss": 0.5}), maxlen=1000)
    r.hset(K.versions, "trainer", 1)
    assert r.xrevrange(K.weights, count=1) and r.xrange(K.weights_applied) == []
    r.xinfo_groups(K.trajectories)
    r.hset(K.heartbeats, "trainer:0", '{"time": 1}')
    users["scheduler"].hset(K.data_end, "scheduler_at", 1.0)
    assert dataend.read(r, K).owed_by_trainer  # the end-of-data handshake: read it, answer it
    dataend.announce_trained(r, K, version=1, step=1)
    assert dataend.read(r, K).end_version == 1


def test_inference_can_do_its_job(users):
    users["trainer"].xadd(K.weights, {"m": schemas.encode(
        schemas.WeightVersion(run=RUN, version=1, step=1, location="/w", checksum="ab"))})  # fmt: skip
    r = users["inference"]
    reply = r.xread({K.weights: "0"}, count=10, block=100)
    assert schemas.decode(reply[0][1][0][1][schemas.ENTRY_FIELD]).version == 1
    assert r.xrevrange(K.weights, count=1)
    bus.publish(r, K.weights_applied, schemas.WeightApplied(run=RUN, node="node-a", version=1, load_s=0.1))
    r.hset(K.versions, "inference:node-a", 1)
    r.hset(K.heartbeats, "inference:node-a", '{"time": 1}')
    bus.dead_letter(r, K.deadletter, source=K.weights, entry_id="1-0", reason="bad checksum", raw=b"")


def test_monitor_reads_the_whole_run(users):
    _scheduler_dispatches(users["scheduler"])
    users["trainer"].hset(K.versions, "trainer", 3)
    record_once(users["runner"], K, RunWarning("train_agent_unused", "solver", "no call", 1.0, "runner:a"))
    state = snapshot(users["monitor"], K)  # exactly what the dashboard and /metrics read
    assert state["ledger"]["dispatched"] == 4 and state["versions"]["trainer"] == 3
    assert [w["subject"] for w in state["warnings"]] == ["solver"]
    # `squall status`/`peek` tell that the run exists with EXISTS; listing runs needs SCAN, refused
    assert has_run(users["monitor"], K)
    with pytest.raises(redis.exceptions.NoPermissionError):  # another run's keys: said, not hidden
        has_run(users["monitor"], Keys(OTHER_RUN))
    assert runs_in(users["monitor"]) is None and runs_in(users["admin"]) == [RUN]
    assert {(g["stream"], g["group"]) for g in state["groups"]} >= {
        ("tasks", "runners"),
        ("trajectories", "trainer"),
    }
    users["monitor"].xpending(K.tasks, GROUP_RUNNERS)
    # the stall detectors (dashboard, `squall status`, and the scheduler's StallWatch) read with
    # the monitor's and the scheduler's grants
    bus.dead_letter(users["scheduler"], K.deadletter, source=K.tasks, entry_id="1-0", reason="bad", raw=b"")
    stalls = snapshot(users["monitor"], K, Thresholds(deadletter_min=1))["stalls"]
    assert [s["kind"] for s in stalls] == ["deadletters_rising"]
    found = detect(users["scheduler"], K, Thresholds(deadletter_min=1))
    assert [s.kind for s in found] == ["deadletters_rising"]


# --- what each service must not do is refused --------------------------------------------------

EVERYONE_FORBIDDEN = [
    ("flushall", ()), ("flushdb", ()), ("config_get", ("*",)), ("keys", ("*",)), ("scan", ()),
    ("acl_list", ()), ("script_flush", ()),
    ("info", ()), ("client_list", ()), ("publish", ("chan", "x")), ("delete", (K.ledger,)),
    ("xadd", (Keys(OTHER_RUN).tasks, {"m": b"x"})), ("xlen", (Keys(OTHER_RUN).tasks,)),
]  # fmt: skip


@pytest.mark.parametrize("user", acl.SERVICES)
def test_dangerous_and_other_run_commands_are_refused(users, user):
    r = users[user]
    for name, args in EVERYONE_FORBIDDEN:
        assert refused(getattr(r, name), *args), f"{user} may {name}{args}"
    assert refused(r.execute_command, "EVAL", "return 1", 0), f"{user} may EVAL arbitrary scripts"
    # commands too harmful to try for real: ask the server whether the user could
    for command in (["SHUTDOWN"], ["DEBUG", "OBJECT", K.tasks], ["MONITOR"], ["CONFIG", "SET", "dir", "/"],
                    ["MODULE", "LIST"], ["REPLICAOF", "NO", "ONE"], ["SCRIPT", "KILL"], ["BGSAVE"]):  # fmt: skip
        answer = users["admin"].execute_command("ACL", "DRYRUN", f"squall-{user}", *command)
        assert b"no permissions" in answer, f"{user} may {command}: {answer!r}"
    assert users["admin"].execute_command("ACL", "DRYRUN", f"squall-{user}", "PING") == b"OK"


def test_runner_is_refused_what_it_must_not_do(users):
    _scheduler_dispatches(users["scheduler"])
    r = users["runner"]
    assert refused(r.xadd, K.tasks, {"m": b"x"})  # cannot dispatch tasks
    assert refused(r.xreadgroup, GROUP_TRAINER, "evil", {K.trajectories: ">"})  # cannot read trajectories
    assert refused(r.xinfo_groups, K.trajectories)  # nor see the trainer's group state
    assert refused(r.xpending, K.trajectories, GROUP_TRAINER)
    assert refused(r.xrange, K.trajectories)
    assert refused(r.hset, K.versions, "trainer", 99)
    assert refused(r.xadd, K.weights, {"m": b"x"})
    assert refused(r.xtrim, K.tasks, maxlen=0)
    assert refused(r.xgroup_destroy, K.tasks, GROUP_RUNNERS)
    assert refused(r.xgroup_setid, K.tasks, GROUP_RUNNERS, "$")
    assert refused(r.xdel, K.tasks, "0-1")
    assert refused(r.xadd, K.control, {"m": b"x"})
    assert refused(r.hgetall, K.groups)
    assert users["admin"].xlen(K.tasks) == 4


def test_trainer_is_refused_what_it_must_not_do(users):
    _scheduler_dispatches(users["scheduler"])
    r = users["trainer"]
    assert refused(r.xadd, K.tasks, {"m": b"x"})
    assert refused(r.xreadgroup, GROUP_RUNNERS, "evil", {K.tasks: ">"})
    assert refused(r.xadd, K.trajectories, {"m": b"x"})  # consumes trajectories, never forges them
    assert refused(r.hset, K.groups, "g0", "{}")
    assert refused(r.xadd, K.control, {"m": b"x"})
    assert refused(r.xadd, K.weights_applied, {"m": b"x"})
    assert refused(r.xgroup_destroy, K.trajectories, GROUP_SCHEDULER)


def test_inference_is_refused_what_it_must_not_do(users):
    r = users["inference"]
    assert refused(r.xadd, K.weights, {"m": b"x"})  # cannot publish a policy
    assert refused(r.xlen, K.tasks)
    assert refused(r.xreadgroup, GROUP_TRAINER, "evil", {K.trajectories: ">"})
    assert refused(Ledger(r, K).counts)
    assert refused(r.hset, K.groups, "g0", "{}")


def test_scheduler_is_refused_what_it_must_not_do(users):
    r = users["scheduler"]
    assert refused(r.xadd, K.weights, {"m": b"x"})  # only the trainer publishes weights
    assert refused(r.xadd, K.metrics, {"m": b"x"})
    assert refused(r.hset, K.versions, "trainer", 99)
    assert refused(r.xadd, K.weights_applied, {"m": b"x"})
    assert refused(r.xadd, K.trajectories, {"m": b"x"})


def test_monitor_writes_nothing(users):
    _scheduler_dispatches(users["scheduler"])
    r = users["monitor"]
    assert refused(r.xadd, K.events, {"m": b"x"})
    assert refused(r.hset, K.heartbeats, "monitor", "{}")
    assert refused(r.xreadgroup, GROUP_RUNNERS, "evil", {K.tasks: ">"})  # would take a task
    assert refused(r.xack, K.tasks, GROUP_RUNNERS, "0-1")
    assert refused(r.xgroup_create, K.tasks, "evil", "0")
    assert refused(Ledger(r, K).move, ["g0:0#0"], "trained")
    assert refused(r.execute_command, "SCRIPT", "LOAD", "return 1")


def test_acl_command_writes_usable_files_for_tls(tmp_path):
    written = acl.write_acl(tmp_path, "demo", tls=True, host="redis.internal", port=6380)
    url = _env(written["runner"])["SQUALL_RUN__REDIS_URL"]
    assert url.startswith("rediss://squall-runner:") and url.endswith("@redis.internal:6380/0")
    assert _env(written["runner"])["SQUALL_RUN__NAME"] == "demo"
    assert os.stat(written["acl"]).st_mode & 0o077 == 0
    assert written["runner.url"].read_text() == url + "\n"  # what SQUALL_RUN__REDIS_URL_FILE reads
    assert os.stat(written["runner.url"]).st_mode & 0o077 == 0


@pytest.mark.parametrize("xdg", [True, False])
def test_default_out_is_outside_the_checkout_and_private(tmp_path, xdg):
    """Without --out the secrets go to $XDG_CONFIG_HOME/squall/secrets/RUN (else ~/.config/...),
    never into the checkout; the folder is 0700 and every file 0600."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XDG_CONFIG_HOME"}
    env["HOME"] = str(home)
    if xdg:
        env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "squall.cli", "acl", "--run", RUN],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    want = (tmp_path / "xdg" if xdg else home / ".config") / "squall" / "secrets" / RUN
    assert str(want) in done.stderr
    assert stat.S_IMODE(want.stat().st_mode) == 0o700
    files = sorted(p.name for p in want.iterdir())
    users = (*acl.SERVICES, acl.ADMIN_USER)
    assert files == sorted([acl.ACL_FILE, *(f"{u}.env" for u in users), *(f"{u}.url" for u in users)])
    for path in want.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert not (repo / "deploy" / "secrets").exists() or not any((repo / "deploy" / "secrets").iterdir())


def test_secret_folders_inside_the_checkout_are_git_ignored():
    repo = Path(__file__).resolve().parents[1]
    paths = ["deploy/secrets/runner.env", "deploy/containers/secrets/users.acl"]
    done = subprocess.run(
        ["git", "check-ignore", *paths], cwd=repo, capture_output=True, text=True, timeout=30
    )
    if done.returncode == 128:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    assert done.stdout.split() == paths


@pytest.mark.parametrize("user", [name for name in acl.SERVICES if name != "trainer"])
def test_only_the_trainer_appends_to_weights(users, user):
    """Garbage XADDed to `weights` by any other service user is refused and never reaches a
    reader; the trainer's own announcement goes through and is what the readers find."""
    from squall.shared import weightstream

    trainer = users["trainer"]
    bus.publish(
        trainer, K.weights, schemas.WeightVersion(run=RUN, version=3, step=3, location="/w", checksum="ab")
    )
    assert not any(name for name, grants in acl.MATRIX.items() if name != "trainer" for g in grants
                   if "weights" in g.keys and g.write and set(g.commands) & {"xadd"})  # fmt: skip
    assert refused(users[user].xadd, K.weights, {"m": b"\x00garbage"}), f"{user} may append to weights"
    assert refused(users[user].xadd, K.weights, {"m": schemas.encode(
        schemas.WeightVersion(run=RUN, version=99, step=99, location="/evil", checksum="00"))})  # fmt: skip
    assert users["admin"].xlen(K.weights) == 1
    found = weightstream.newest_valid(users["admin"], K.weights, "test")
    assert found.version is not None and found.version.version == 3 and found.skipped == 0


def test_resources_and_the_optimizer_work_as_their_users(users):
    """The scheduler publishes the run file's resources, a runner reads a pinned version, the
    optimiser publishes a candidate, reads its group and checkpoints; a runner may not publish."""
    assert resources.publish_initial(users["scheduler"], K, {"system_prompt": "be brief"}, source="config")
    assert resources.current_pins(users["scheduler"], K)["system_prompt"][0] >= 1
    assert resources.ResourceCache(users["runner"], K).texts_for({"system_prompt": 1}) == {
        "system_prompt": "be brief"
    }
    opt = users["optimizer"]
    candidate = resources.publish(
        opt, K, "system_prompt", "be briefer", current=False, source="optimizer:apo"
    )
    consumer = bus.GroupConsumer(opt, K.trajectories, "optimizer", "optimizer", kind=schemas.Trajectory,
                                 deadletter_stream=K.deadletter)  # fmt: skip
    consumer.read(10, block_ms=10)
    opt.hset(K.optimizer_state, "state", "{}")
    bus.publish(opt, K.optimizer_calls, schemas.Event(run=RUN, service="optimizer", name="editor_call"))
    assert users["admin"].hexists(K.resources_versions, f"system_prompt@{candidate.version}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        resources.publish(users["runner"], K, "system_prompt", "forged")
