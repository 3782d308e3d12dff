"""The trainer rides through a Redis restart (AOF on, same port) mid-run and trains every key
exactly once; when Redis stays down past run.redis_outage_s it exits non-zero naming the URL."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis
import torch
from test_trainer_e2e import ROOT, trained_log, write_config
from test_trainer_step import make_tiny_model, sampled_trajectory
from waiting import wait_for

from squall.shared import bus
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import LocalRedis
from squall.shared.schemas import Trajectory

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def groups(model, run: str, names: list[str]) -> list[Trajectory]:
    out = []
    for g in names:
        for i in range(4):
            t = sampled_trajectory(model, g, i, float(i % 2), seed=ord(g[0]) * 10 + i)
            out.append(Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "run": run}))
    return out


def start(config, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "squall.cli", "trainer", "--config", str(config), *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def config_with_outage(tmp_path, url, run_name, model_path, outage_s: float):
    path = write_config(tmp_path, url, run_name, model_path)
    text = path.read_text().replace(
        "autostart_redis = false", f"autostart_redis = false\nredis_outage_s = {outage_s}"
    )
    path.write_text(text)
    return path


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_trainer_rides_through_a_redis_restart(tmp_path, run_name):
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    server = LocalRedis(data_dir=tmp_path / "redis", aof=True).start()
    r = redis.Redis.from_url(server.url)
    keys = Keys(run_name)
    model_path = make_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_path)
    before, after = groups(model, run_name, ["a", "b", "c"]), groups(model, run_name, ["d", "e", "f"])
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    bus.publish_many(r, keys.trajectories, before)
    config = config_with_outage(tmp_path, server.url, run_name, model_path, outage_s=60)
    run_dir = tmp_path / "run"
    proc = start(config, "--max-steps", "6")
    try:
        wait_for(lambda: len(trained_log(run_dir)) >= 2 or proc.poll() is not None, 120, "step 2")
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        r.shutdown()  # AOF flushed; the trainer is mid-run (step 3's group is waiting)
        server.process.wait(10)
        time.sleep(2.0)  # the trainer finds Redis gone and waits for it
        server = LocalRedis(port=server.port, data_dir=tmp_path / "redis", aof=True).start()
        r = redis.Redis.from_url(server.url)
        bus.publish_many(r, keys.trajectories, after)
        rc = proc.wait(180)
    finally:
        stop(proc)
    stderr = proc.stderr.read().decode()
    assert rc == 0, stderr[-3000:]
    assert "redis_outage" in stderr  # it did ride through one

    log = trained_log(run_dir)
    assert [line["step"] for line in log] == list(range(1, 7))
    trained = [k for line in log for k in line["keys"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert set(trained) == {t.key for t in before + after}
    ledger = Ledger(r, keys)
    assert {ledger.state_of(k) for k in trained} == {"trained"} and ledger.balanced()
    assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0
    assert int(r.hget(keys.versions, "trainer")) == 6
    server.close()


def test_trainer_exits_naming_the_url_when_redis_stays_down(tmp_path, run_name):
    server = LocalRedis(data_dir=tmp_path / "redis").start()
    r = redis.Redis.from_url(server.url)
    model_path = make_tiny_model(tmp_path / "model")
    config = config_with_outage(tmp_path, server.url, run_name, model_path, outage_s=2)
    proc = start(config)
    try:
        wait_for(
            lambda: r.hexists(Keys(run_name).heartbeats, "trainer:trainer") or proc.poll() is not None,
            120,
            "the trainer's first heartbeat",
        )
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        server.close()
        rc = proc.wait(60)
    finally:
        stop(proc)
    stderr = proc.stderr.read().decode()
    assert rc != 0 and server.url in stderr and "did not come back within 2s" in stderr, stderr[-3000:]
