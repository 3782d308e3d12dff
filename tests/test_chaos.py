"""Chaos: seeded random faults on a short real run, and nothing is lost or trained twice.

The run is the one of test_sigterm (inference on a tiny random model, the trainer, the
scheduler and two runners with a tiny-LLM agent, all subprocesses) on a Redis of the test's own
(AOF on), so that Redis itself can be restarted. While the dataset flows, the test injects
faults drawn from a seeded generator, every kind at least once:

    kill9       SIGKILL of a runner, the trainer, the scheduler or the inference node, which
                is started again at once (a preemptible machine coming back)
    sigstop     a runner paused past its lease, then continued (its tasks were reclaimed)
    redis       SHUTDOWN of Redis (AOF written), started again on the same port and folder
    garbage     bytes that are no message XADDed to tasks, trajectories, control or weights

Once the last fault is in, the run is drained (Control `drain`: no new group, the open ones
run to their end). Then: the ledger balances with nothing left in flight, every group
dispatched rolled out, no key was trained twice and every trained key is `trained`, no member was given up for an
infrastructure reason (the `infra` hash has no given_up:*), each inference node's `versions`
field equals the version its /health reports, and every service is alive (or, the scheduler,
exited 0 having finished). The figures are printed.

Reproduce: the seed is printed and kept with the fault log in test-artifacts/chaos-<seed>.jsonl;
SQUALL_CHAOS_SEED=<seed> runs the same draw again (timings still differ: processes are real).
SQUALL_CHAOS_FAULTS sets the number of faults (default 32).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from runner_helpers import Procs, events, log_of, write_jsonl
from test_sigterm import UNSETTLED, Run, write_run_file
from waiting import wait_for

from squall.inference.tiny import build_tiny_model
from squall.shared import bus, schemas
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import LocalRedis, free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
FAULTS = int(os.environ.get("SQUALL_CHAOS_FAULTS", "32"))
SAMPLES = 400  # more than the faults take: the run is drained once the last fault is in
LEASE_S = 3.0
# Every fault once, then draws weighted towards the cheap ones (a restart costs seconds of a 2-core machine).
KINDS = {
    "kill9:runner": 2, "kill9:trainer": 1, "kill9:scheduler": 1, "kill9:inference": 1, "sigstop:runner": 2,
    "redis:restart": 1, "garbage:tasks": 1, "garbage:trajectories": 1, "garbage:control": 1, "garbage:weights": 2,
}  # fmt: skip
GARBAGE = (b"\xc1 not msgpack", b"", b'{"kind": "task"}', os.urandom(64))


class Chaos:
    """Draws and applies faults; every one is appended to the fault log as it happens."""

    def __init__(self, run: Run, server: LocalRedis, seed: int, log_path: Path) -> None:
        self.run, self.server, self.rng = run, server, random.Random(seed)
        self.log_path, self.started = log_path, time.monotonic()
        self.done: Counter[str] = Counter()
        self.paused: list[threading.Timer] = []

    def plan(self, n: int) -> list[str]:
        kinds = list(KINDS)
        plan = kinds + self.rng.choices(kinds, weights=list(KINDS.values()), k=max(0, n - len(kinds)))
        self.rng.shuffle(plan)
        # Issue 21's stall: a malformed newest `weights` entry, then an inference restart.
        garbage, restart = plan.index("garbage:weights"), plan.index("kill9:inference")
        if restart < garbage:
            plan[garbage], plan[restart] = plan[restart], plan[garbage]
        return plan

    def note(self, kind: str, **detail: object) -> None:
        self.done[kind] += 1
        line = {"t": round(time.monotonic() - self.started, 2), "kind": kind, **detail}
        with open(self.log_path, "a") as out:
            out.write(json.dumps(line) + "\n")
        print(f"chaos {line}")

    def revive(self) -> None:
        """Act as the supervisor (systemd's Restart=on-failure): a service that exited non-zero
        (e.g. started while Redis was down: a start waits only a few seconds for Redis) is
        logged with its last words and started again. A finished scheduler (exit 0) stays down."""
        for name, proc in list(self.run.live.items()):
            if proc.poll() is None or (name == "scheduler" and proc.returncode == 0):
                continue
            last = log_of(proc).strip().splitlines()[-1:] or [""]
            self.note("exited", target=name, rc=proc.returncode, last=last[0][:300])
            self.run.start(name)

    def apply(self, kind: str) -> None:
        action, target = kind.split(":")
        getattr(self, f"_{action}")(target)

    def _kill9(self, service: str) -> None:
        name = self.rng.choice(("runner-1", "runner-2")) if service == "runner" else service
        proc = self.run.live[name]
        if proc.poll() is not None:  # the scheduler, finished: nothing to kill
            self.note(f"kill9:{service}", target=name, skipped=f"exited {proc.returncode}")
            return
        proc.kill()
        proc.wait(10)
        self.run.start(name)
        self.note(f"kill9:{service}", target=name, pid=proc.pid)

    def _sigstop(self, _: str) -> None:
        name = self.rng.choice(("runner-1", "runner-2"))
        proc = self.run.live[name]
        pause_s = LEASE_S + self.rng.uniform(1.0, 3.0)
        proc.send_signal(signal.SIGSTOP)
        timer = threading.Timer(pause_s, lambda: proc.poll() is None and proc.send_signal(signal.SIGCONT))
        timer.start()
        self.paused.append(timer)
        self.note("sigstop:runner", target=name, pid=proc.pid, pause_s=round(pause_s, 2))

    def _redis(self, _: str) -> None:
        down_s = self.rng.uniform(0.5, 2.0)
        try:
            redis.Redis(port=self.server.port).shutdown(nosave=False)
        except redis.ConnectionError:
            pass
        self.server.close()
        time.sleep(down_s)
        self.server = LocalRedis(port=self.server.port, data_dir=self.server.data_dir, aof=True).start()
        self.note("redis:restart", down_s=round(down_s, 2))

    def _garbage(self, stream: str) -> None:
        raw = self.rng.choice(GARBAGE)
        key = getattr(self.run.keys, stream)
        self.run.r.xadd(key, {b"m": raw} if raw else {b"x": b"no m field"})
        self.note(f"garbage:{stream}", size=len(raw))

    def settle(self) -> None:
        for timer in self.paused:
            timer.join()


def served_versions(r: redis.Redis, keys: Keys, port: int) -> tuple[dict[str, int], int]:
    fields = {k.decode(): int(v) for k, v in r.hgetall(keys.versions).items() if k.startswith(b"inference:")}
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
    return fields, int(health["weight_version"])


@pytest.mark.timeout(420)
def test_seeded_chaos_loses_nothing_and_trains_nothing_twice(tmp_path, run_name):
    seed = int(os.environ.get("SQUALL_CHAOS_SEED") or random.SystemRandom().randrange(1 << 31))
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / f"chaos-{seed}.jsonl"
    log_path.write_text(json.dumps({"seed": seed, "faults": FAULTS, "samples": SAMPLES}) + "\n")
    print(f"chaos seed {seed} (SQUALL_CHAOS_SEED={seed} repeats the draw); fault log {log_path}")

    server = LocalRedis(data_dir=tmp_path / "redis", aof=True).start()
    # The test's own client rides through the Redis restarts it causes.
    r = redis.Redis.from_url(server.url, retry=Retry(ExponentialBackoff(cap=1.0), 20),
                             retry_on_error=[redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError])  # fmt: skip
    model = build_tiny_model(tmp_path / "model")
    rows = [{"id": f"s{i}", "question": f"What is {i} plus {i}?", "sleep": 0.5} for i in range(SAMPLES)]
    dataset = write_jsonl(tmp_path / "data.jsonl", rows)
    port = free_port()
    config = write_run_file(tmp_path, server.url, run_name, model, dataset, port, overrides={
        "run": {"redis_outage_s": 90.0, "autostart_redis": False},
        "scheduler": {"max_attempts": 3, "standby_after_s": 3.0, "max_inflight_groups": 4,
                      "infra_backoff_s": 0.5, "infra_backoff_max_s": 4.0},
        "runner": {"lease_s": LEASE_S, "upstream_retries": 2, "behind_wait_s": 30.0, "concurrency": 3},
    })  # fmt: skip
    procs = Procs(server.url, run_name, tmp_path)
    run = Run(r, procs, config, port)
    chaos = Chaos(run, server, seed, log_path)
    started = time.monotonic()
    try:
        for name in ("inference", "trainer", "runner-1", "runner-2"):
            run.start(name)
        for name in ("inference", "trainer", "runner-1", "runner-2"):
            run.wait_started(name, within_s=180)  # cold starts import torch: slow on a busy machine
        run.start("scheduler")
        wait_for(lambda: run.flowing_after(0), 60, "work flowing before the first fault")

        for kind in chaos.plan(FAULTS):
            time.sleep(chaos.rng.uniform(0.5, 2.5))
            chaos.revive()
            assert run.live["scheduler"].poll() is None, f"the run ended after {chaos.done.total()} faults"
            chaos.apply(kind)
        chaos.settle()
        chaos.revive()
        faults_s = time.monotonic() - started
        # Drain: no new group, the open ones run to their end, then the scheduler finishes.
        bus.publish(r, run.keys.control, schemas.Control(run=run_name, action="drain"))

        scheduler = run.live["scheduler"]
        assert scheduler.wait(180) == 0, log_of(scheduler)[-3000:]
        assert [e.fields["reason"] for e in events(r, run_name, "finished")][-1:] == ["drained"]
        try:
            wait_for(run.settled, 90, "every attempt trained, filtered or retired and every entry acked")
        except AssertionError as exc:
            unsettled = {k.decode(): v.decode() for k, v in r.hgetall(run.keys.attempts).items()
                         if v.decode() in UNSETTLED}  # fmt: skip
            trainer_log = log_of(run.live["trainer"])[-2000:]
            raise AssertionError(
                f"{exc}: ledger {run.counts()}, groups {run.group_infos()}, "
                f"unsettled {dict(list(unsettled.items())[:10])}, trainer log {trainer_log}"
            ) from None

        keys = Keys(run_name)
        ledger = Ledger(r, keys)
        counts = ledger.counts()
        infra = {k.decode(): int(v) for k, v in r.hgetall(keys.infra).items()}
        trained = run.trained_keys()
        twice = [k for k, n in Counter(trained).items() if n > 1]
        wait_for(lambda: len(set(served_versions(r, keys, port)[0].values()) | {served_versions(r, keys, port)[1]}) == 1,
                 30, "versions to equal what the node serves")  # fmt: skip
        fields, health = served_versions(r, keys, port)
        groups_dispatched = {key.decode().split(":")[0] for key in r.hkeys(keys.attempts)}
        deadletters = r.xlen(keys.deadletter)
        print(f"chaos figures: seed={seed} faults={dict(chaos.done)} ({chaos.done.total()} in {faults_s:.0f}s), "
              f"ledger={counts}, infra={infra}, trained_keys={len(trained)}, trained_twice={len(twice)}, "
              f"dead_letters={deadletters}, versions={fields} health={health}, "
              f"total={time.monotonic() - started:.0f}s")  # fmt: skip

        assert sum(chaos.done[k] for k in KINDS) >= FAULTS and set(KINDS) <= set(chaos.done), chaos.done
        assert ledger.balanced(), counts
        assert not [s for s in UNSETTLED if counts.get(s)], counts  # 0 lost: nothing owed a move
        open_groups = [json.loads(raw) for raw in r.hvals(keys.groups)]  # only those held for the trainer
        assert groups_dispatched and all(g["rolled_out"] for g in open_groups), open_groups
        assert not twice, f"trained twice: {twice[:5]}"
        assert trained and {ledger.state_of(key) for key in trained} == {"trained"}
        assert counts.get("trained", 0) == len(trained)
        assert not {k: v for k, v in infra.items() if k.startswith("given_up:")}, infra
        assert fields and set(fields.values()) == {health}, (fields, health)
        for name in ("inference", "trainer", "runner-1", "runner-2"):
            proc = run.live[name]
            assert proc.poll() is None, f"{name} is not running at the end:\n{log_of(proc)[-3000:]}"
        with open(log_path, "a") as out:
            out.write(json.dumps({"result": "passed", "ledger": counts, "infra": infra}) + "\n")
    finally:
        chaos.settle()
        procs.stop_all()
        for proc in procs.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        chaos.server.close()
        for proc in procs.procs:
            assert proc.poll() is not None
