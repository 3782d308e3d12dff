"""The end of a run (issue 16): the last partial step trains, the end validation measures the
final published version, stopped services read as stopped, a finished run has no open group.

Real parts throughout: a real Redis, the trainer as a process on a real tiny model, and a whole
`squall up` on the calculator policy with a dataset that does not fill its last step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner_helpers import events, tasks, write_jsonl
from test_scheduler_run import finish_all_as_runner, make_config, reward_points
from test_trainer_e2e import start_trainer, trained_log, write_config
from test_trainer_step import make_tiny_model, sampled_trajectory
from waiting import wait_for

from squall.api import UpResult
from squall.local.up import measured_word
from squall.monitor.status import collect, render
from squall.scheduler.ending import Ending
from squall.scheduler.scheduler import Scheduler
from squall.shared import bus, dataend, schemas
from squall.shared.config import SchedulerSection
from squall.shared.heartbeat import HeartbeatWriter
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.logs import get_logger
from squall.shared.runstate import read_snapshot

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "examples" / "calc" / "policy"


def test_a_cleanly_stopped_heartbeat_reads_as_stopped_and_a_silent_one_as_gone(r, run_name):
    keys = Keys(run_name)
    clean = HeartbeatWriter(r, keys, "trainer", "t0")
    clean.beat(version=3, step=7.0, open_groups=2.0)
    died = HeartbeatWriter(r, keys, "runner", "r0")
    died.beat(version=3)
    states = {p.id: p.state for p in read_snapshot(r, keys).processes}
    assert states == {"trainer:t0": "alive", "runner:r0": "alive"}
    clean.stop(open_groups=0)
    snap = read_snapshot(r, keys)
    (trainer,) = [p for p in snap.processes if p.service == "trainer"]
    assert trainer.state == "stopped" and not trainer.alive and snap.alive("trainer") == []
    assert trainer.fields()["version"] == 3 and trainer.fields()["step"] == 7.0  # its last word kept
    assert trainer.fields()["open_groups"] == 0.0
    assert json.loads(r.hget(keys.heartbeats, "trainer:t0"))["stopped"] > 0  # redis-cli shows it
    lines = render(collect(r, run_name)).splitlines()
    assert any("trainer:t0" in line and " stopped " in line for line in lines), lines
    assert any("runner:r0" in line and " alive " in line for line in lines), lines


def test_the_end_round_waits_for_the_trainers_last_version_and_for_the_nodes_serving_it(
    r, redis_url, run_name, tmp_path
):
    keys, ledger = Keys(run_name), Ledger(r, Keys(run_name))
    config = make_config(redis_url, run_name, write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(3)]),
                         val_dataset=str(write_jsonl(tmp_path / "v.jsonl", [{"id": "v0"}])), group_size=1,
                         hold_until_trained=True, val_every=1, poll_s=0.05, trainer={"groups_per_step": 2})  # fmt: skip
    sched = Scheduler(config, r)
    trainer = HeartbeatWriter(r, keys, "trainer", "trainer")
    follower, snapshot = (HeartbeatWriter(r, keys, "inference", name) for name in ("n0", "snap"))

    def beat(node_version: int) -> None:  # the live processes, as they write their heartbeats
        trainer.beat(force=True, version=int(r.hget(keys.versions, "trainer") or 0))
        follower.beat(force=True, version=node_version, follows_newest=1.0)
        snapshot.beat(force=True, version=0, follows_newest=0.0)  # a pinned opponent: never moves
        r.hset(keys.versions, mapping={"inference:n0": node_version, "inference:snap": 0})

    def val_tasks() -> list[schemas.Task]:
        return [t for t in tasks(r, run_name) if t.mode == "val"]

    beat(0)
    for _ in range(20):  # the first round, and the data: 3 groups, a step of 2 trained
        sched.step()
        done = finish_all_as_runner(r, run_name)
        first_two = sorted({t.group_id for t in tasks(r, run_name) if t.mode == "train"})[:2]
        ledger.move([k for k in done if k.split(":")[0] in first_two], "trained")
    r.hset(keys.versions, "trainer", 1)  # the step of 2 published as version 1; one group held
    for _ in range(10):
        beat(1)
        assert sched.step()
    assert dataend.read(r, keys).owed_by_trainer and len(val_tasks()) == 1  # no round on version 1
    assert ledger.counts()["ok"] == 1  # the third group, held: less than a step
    assert [e.fields["held_groups"] for e in events(r, run_name, "data_end")] == [1]

    held = [k.decode() for k, v in r.hgetall(keys.attempts).items() if v == b"ok"]
    ledger.move(held, "trained")  # the trainer's last, smaller step: version 2
    r.hset(keys.versions, "trainer", 2)
    dataend.announce_trained(r, keys, version=2, step=2)
    for _ in range(10):
        beat(1)  # the node still serves 1: the round would measure old weights
        assert sched.step()
    assert len(val_tasks()) == 1 and sched.end_version() == 2
    beat(2)
    wait_for(lambda: sched.step() and len(val_tasks()) == 2, 10, "the end round")
    assert val_tasks()[-1].min_version == 2
    finish_all_as_runner(r, run_name, reward=0.5)
    wait_for(lambda: not sched.step(), 10, "the scheduler to finish")
    last_round = [p for p in reward_points(r, keys) if p.mode == "val"][-1]
    assert (last_round.version, last_round.mean) == (2, 0.5)
    (finished,) = events(r, run_name, "finished")
    assert finished.fields["end_version"] == 2 and finished.fields["open_groups"] == 0
    assert (
        sched.groups == {} and r.hlen(keys.groups) == 0 and ledger.balanced() and "ok" not in ledger.counts()
    )
    assert (
        events(r, run_name, "end_unconfirmed") == [] and events(r, run_name, "end_round_nodes_behind") == []
    )


@pytest.mark.redis
def test_with_trained_roles_the_end_round_waits_for_each_roles_final_version_on_the_node(r, run_name):
    """A node serves a version per role, each in its own `versions` field; its own field (the
    default role's) never moves in such a run, and the end round waited on it until end_wait_s."""
    keys = Keys(run_name)
    ending = Ending(r, keys, SchedulerSection(end_wait_s=600), get_logger())
    HeartbeatWriter(r, keys, "inference", "n0").beat(force=True, version=0, follows_newest=1.0)
    dataend.announce_data_end(r, keys, samples=16)
    answers = {dataend.role_answer_field("villagers"): 3, dataend.role_answer_field("wolves"): 4}
    r.hset(keys.data_end, mapping=answers)
    dataend.announce_trained(r, keys, version=3, step=4)  # the run's answer: the first role's version
    r.hset(keys.versions, mapping={"inference:n0": 0, "inference:n0:villagers": 3, "inference:n0:wolves": 3})
    assert dataend.role_answers(r.hgetall(keys.data_end)) == {"villagers": 3, "wolves": 4}
    assert not ending.served(3)  # the wolves' weights there are one version old
    r.hset(keys.versions, "inference:n0:wolves", 4)
    assert ending.served(3)
    r.hset(keys.data_end, dataend.role_answer_field("policy"), 2)  # a role named as the default one
    assert not ending.served(3)  # its version is the node's own field's, still 0
    r.hset(keys.versions, "inference:n0", 2)
    assert ending.served(3)


def test_the_summary_says_which_version_the_last_round_measured():
    def word(measured, last):
        return measured_word({"val_reward_end_version": measured, "trainer_last_version": last})

    assert word(4, 4) == "(version 4, the final one)"
    assert word(3, 4) == "(version 3, NOT the final version 4)"
    assert word(3, None) == "(version 3; the trainer did not report a last version)"  # e.g. --minutes
    assert word(None, 4) == "(no validation)" and measured_word({}) == "(no validation)"  # an old summary
    result = UpResult(0, "done", Path("/r"), {"val_reward_start": 0.1, "val_reward_end": 0.5,
                                              "val_reward_end_version": 4, "trainer_last_version": 4})  # fmt: skip
    assert "validation reward 0.100 -> 0.500 (version 4, the final one)" in str(result)


def publish_groups(r, keys: Keys, model, groups: int) -> set[str]:
    """`groups` trainable groups of 4 (rewards 0/1), dispatched and finished ok in the ledger as
    a scheduler and runners would leave them; returns their keys."""
    messages = []
    for g in range(groups):
        for i in range(4):
            t = sampled_trajectory(model, f"g{g}", i, float((i + g) % 2), seed=10 * g + i)
            messages.append(
                schemas.Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "run": keys.run})
            )
    ledger = Ledger(r, keys)
    ledger.apply("dispatch", [t.key for t in messages])
    ledger.move([t.key for t in messages], "ok")
    bus.publish_many(r, keys.trajectories, messages)
    return {t.key for t in messages}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("groups", "steps", "version", "last_step_version", "garbage"),
    [
        (5, 3, 1, 1, False),  # 2 + 2, then the last group alone: a smaller step, published though 3 % 4 != 0
        (4, 2, 1, 0, False),  # 2 + 2, nothing left: the unpublished steps get a version of their own after
        # the newest `weights` entry malformed (issue 21): the trainer neither reads nor trusts it
        (4, 2, 1, 0, True),
    ],
)
def test_the_trainer_trains_what_it_holds_when_the_data_ends(
    tmp_path, r, redis_url, run_name, groups, steps, version, last_step_version, garbage
):
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model_path = make_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_path)
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainable = publish_groups(r, keys, model, groups)
    config = write_config(tmp_path, redis_url, run_name, model_path, groups_per_step=2, publish_every=4)
    run_dir = tmp_path / "run"
    proc = start_trainer(config)
    try:
        held = 4 * (groups - 4)  # less than a step's worth: the trainer holds it

        def two_steps_settled() -> bool:
            return proc.poll() is not None or Ledger(r, keys).counts().get("trained", 0) == 16

        wait_for(two_steps_settled, 180, "two full steps, trained in the ledger")
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert Ledger(r, keys).counts().get("ok", 0) == held and len(trained_log(run_dir)) == 2
        assert int(r.hget(keys.versions, "trainer")) == 0  # publish_every=4: nothing published yet
        if garbage:
            r.xadd(keys.weights, {schemas.ENTRY_FIELD: b"\xc1 not a WeightVersion"})
            r.xadd(keys.weights, {b"other": b"no m field"})
        dataend.announce_data_end(r, keys, samples=groups)  # as the scheduler does
        answer = wait_for(lambda: dataend.read(r, keys).trainer_version is not None and dataend.read(r, keys),
                          60, "the trainer's answer")  # fmt: skip
    finally:
        proc.terminate()
        rc = proc.wait(60)
    assert rc == 0, proc.stderr.read().decode()[-3000:]
    log = trained_log(run_dir)
    assert [line["step"] for line in log] == list(range(1, steps + 1))
    assert log[-1]["version"] == last_step_version  # the version the last step's own commit made
    assert {k for line in log for k in line["keys"]} == trainable  # every key trained, once
    assert answer.trainer_version == version and answer.trainer_step == steps
    (newest,) = r.xrevrange(keys.weights, count=1)
    published = schemas.decode(newest[1][schemas.ENTRY_FIELD], schemas.WeightVersion)
    assert (published.version, published.step) == (version, steps)  # the answer is what was published
    assert int(r.hget(keys.versions, "trainer")) == version
    counts = Ledger(r, keys).counts()
    assert "ok" not in counts and counts["trained"] == len(trainable), counts
    assert [e.fields["version"] for e in events(r, run_name, "data_trained")] == [version]
    beat = json.loads(r.hget(keys.heartbeats, "trainer:trainer"))  # SIGTERM: a clean stop
    assert beat["stopped"] > 0 and beat["open_groups"] == 0 and beat["ready_groups"] == 0


@pytest.mark.timeout(720)  # its own subprocess budget, past the suite-wide 300 s
@pytest.mark.slow
@pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="the demo policy is not built")
def test_up_trains_the_last_partial_step_and_validates_the_final_version(tmp_path, r, redis_url, run_name):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "examples.calc.tasks", "--out", str(data), "--train", "7",
                    "--val", "4", "--seed", "0"], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SQUALL_RUN__REDIS_URL": redis_url,  # the test's Redis: the run's keys outlive `squall up`
        "SQUALL_RUN__NAME": run_name,
        "SQUALL_RUN__DIR": str(run_dir),
        "SQUALL_SCHEDULER__DATASET": str(data / "train.jsonl"),
        "SQUALL_SCHEDULER__VAL_DATASET": str(data / "val.jsonl"),
        "SQUALL_SCHEDULER__GROUP_SIZE": "8",
        "SQUALL_SCHEDULER__VAL_EVERY": "1",  # a round at every version while data is left
        "SQUALL_SCHEDULER__VAL_SAMPLES": "4",
        "SQUALL_TRAINER__GROUPS_PER_STEP": "4",  # 7 groups: one full step, then up to 3 left over
        "SQUALL_TORCH_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "squall.cli", "up", "--config", "examples/calc/demo.toml", "--runners", "1",
         "--minutes", "8", "--label", "end"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "scheduler finished the dataset" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    keys = Keys(run_name)

    # Item 4: the leftover groups trained (or were filtered), as a last smaller step.
    counts = Ledger(r, keys).counts()
    assert "ok" not in counts and Ledger(r, keys).balanced(), counts
    assert summary["ledger_balanced"] and "ok" not in summary["ledger"], summary["ledger"]
    # Zero-variance groups are filtered (the policy's luck decides how many): the groups that
    # trained fill steps of 4, and whatever is left over trains as a last, smaller step.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = {k for line in trained_log(run_dir) for k in line["keys"]}
    trained_groups = len({key.split(":")[0] for key in trained})
    per_step = [int(m["groups"]) for m in metrics]
    assert sum(per_step) == trained_groups and per_step == [4] * (trained_groups // 4) + (
        [trained_groups % 4] if trained_groups % 4 else []
    ), (per_step, trained_groups)
    states = {k.decode(): v.decode() for k, v in r.hgetall(keys.attempts).items()}
    assert {k for k, state in states.items() if state == "trained"} == trained  # as the trainer logged
    left = {state for state in states.values() if state not in ("trained", "validated")}
    assert all(state.startswith("filtered:") or state in ("retried", "deadlettered") for state in left), left

    # Item 3: the end round measured the trainer's last published version, and only once.
    end = dataend.read(r, keys)
    last = int(r.hget(keys.versions, "trainer"))
    (newest,) = r.xrevrange(keys.weights, count=1)
    assert schemas.decode(newest[1][schemas.ENTRY_FIELD], schemas.WeightVersion).version == last
    assert end.trainer_version == last == summary["trainer_last_version"] == summary["val_reward_end_version"]
    assert summary["steps"] == metrics[-1]["step"] and last == metrics[-1]["version"]
    assert [p["version"] for p in summary["val_curve"]].count(last) == 1, summary["val_curve"]
    end_rounds = [e for e in events(r, run_name, "val_round_dispatched") if e.fields["end"]]
    assert [e.fields["version"] for e in end_rounds] in ([last], []), end_rounds  # [] : a periodic one had it
    applied = [
        schemas.decode(f[schemas.ENTRY_FIELD], schemas.WeightApplied)
        for _, f in r.xrange(keys.weights_applied)
    ]
    served_at = min(a.applied_at for a in applied if a.version == last)
    assert all(e.time >= served_at for e in end_rounds), (served_at, end_rounds)  # served before it went out
    assert f"val_reward_end={summary['val_reward_end']:.3f} (version {last}, the final one)" in out
    assert events(r, run_name, "end_unconfirmed") == []

    # Item 6b: every service stopped cleanly and reads as stopped; the finished run holds no group.
    status = collect(r, run_name)
    states = {proc["id"]: proc["state"] for proc in status["heartbeats"]}
    assert states and set(states.values()) == {"stopped"}, states
    assert {name.split(":")[0] for name in states} == {"inference", "trainer", "scheduler", "runner"}
    assert status["finished"] and status["open_groups"] == 0, status
    cli = subprocess.run([sys.executable, "-m", "squall.cli", "status", "--run", run_name, "--redis-url", redis_url],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert cli.returncode == 0 and "open_groups=0" in cli.stdout and " alive " not in cli.stdout, cli.stdout
    assert f"trainer: last version v{last}" in cli.stdout, cli.stdout


def test_a_time_limited_run_says_how_far_the_trainer_got():
    summary = {"val_reward_end_version": 0, "trainer_last_version": None, "versions": {"trainer": 4}}
    assert measured_word(summary) == (
        "(version 0; the trainer had reached version 4, which no finished validation round measured)"
    )
    summary["val_reward_end_version"] = 4
    assert measured_word(summary) == "(version 4, the trainer's newest when the run stopped)"
    assert "did not report" in measured_word({"val_reward_end_version": 0, "trainer_last_version": None})


def test_progress_line_generated_tokens_per_second_comes_from_the_nodes_heartbeats(r, run_name):
    """`squall up`'s generated_tok/s: the inference nodes' sampled-token counts (their
    heartbeats) between two progress lines; none before the second line or after a node restart."""
    from squall.local.progress import GenerationRate, sampled_tokens, snapshot

    keys = Keys(run_name)
    nodes = [HeartbeatWriter(r, keys, "inference", name) for name in ("n0", "n1")]
    trainer = HeartbeatWriter(r, keys, "trainer", "t0")
    trainer.beat(force=True, version=1, sampled_tokens=999.0)  # not a node: never counted
    for node, tokens in zip(nodes, (100.0, 50.0), strict=True):
        node.beat(force=True, version=1, sampled_tokens=tokens)
    rate = GenerationRate()
    assert sampled_tokens(snapshot(r, keys)) == 150
    assert rate.update(10.0, sampled_tokens(snapshot(r, keys))) is None  # first line: no interval yet
    for node, tokens in zip(nodes, (400.0, 150.0), strict=True):
        node.beat(force=True, version=1, sampled_tokens=tokens)
    assert rate.update(15.0, sampled_tokens(snapshot(r, keys))) == pytest.approx(80.0)  # (550 - 150) / 5 s
    nodes[0].beat(force=True, version=1, sampled_tokens=10.0)  # n0 restarted: its count began again
    assert rate.update(20.0, sampled_tokens(snapshot(r, keys))) is None
