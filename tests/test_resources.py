"""Resources: publish (versions, checksum, size limits), hand-out to function and command agents,
the version recorded per attempt, a prompt changed mid-run, and the scheduler's staleness."""

from __future__ import annotations

import json
import time

import pytest
from runner_helpers import Procs, log_of, trajectories, write_jsonl

from squall.scheduler import admission
from squall.scheduler.groups import Group
from squall.shared import resources, schemas
from squall.shared.config import load_config
from squall.shared.keys import Keys


def test_publish_versions_current_and_candidates(r, run_name):
    keys = Keys(run_name)
    first = resources.publish(r, keys, "system_prompt", "be brief")
    candidate = resources.publish(r, keys, "system_prompt", "be very brief", current=False)
    assert (first.version, first.generation, candidate.version, candidate.generation) == (1, 1, 2, -1)
    assert resources.current_pins(r, keys) == {"system_prompt": (1, 1)}  # a candidate is not pinned
    promoted = resources.promote(r, keys, "system_prompt", 2, source="test")
    assert (promoted.version, promoted.generation, promoted.content) == (3, 2, "be very brief")
    assert resources.current_pins(r, keys) == {"system_prompt": (3, 2)}
    got = resources.get(r, keys, "system_prompt", 1)
    assert got.checksum == resources.checksum("be brief") and got.size == 8
    # Visible with redis-cli: one stream entry per version, decodable as ResourceVersion.
    stream = [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(keys.resources)]
    assert [(m.version, m.current) for m in stream] == [(1, True), (2, False), (3, True)]
    with pytest.raises(resources.ResourceError, match="no version 9"):
        resources.get(r, keys, "system_prompt", 9)


def test_too_large_and_badly_named_resources_are_refused(r, run_name, tmp_path):
    keys = Keys(run_name)
    with pytest.raises(
        resources.ResourceError, match=r"'big' is 70000 bytes, over the limit of 65536.*location"
    ):
        resources.publish(r, keys, "big", "x" * 70_000)
    huge = tmp_path / "huge.txt"
    huge.write_text("y" * (resources.MAX_BYTES + 1))
    with pytest.raises(resources.ResourceError, match="over the limit of 1048576"):
        resources.publish(r, keys, "big", location=str(huge))
    with pytest.raises(resources.ResourceError, match="resource name 'sys-prompt' is not valid"):
        resources.publish(r, keys, "sys-prompt", "x")
    assert not r.exists(keys.resources) and not r.exists(keys.resources_current)  # nothing half-written
    # A big artifact goes by location: checksummed, read back, and a changed file is refused.
    ok = tmp_path / "few_shot.txt"
    ok.write_text("z" * 70_000)
    version = resources.publish(r, keys, "few_shot", location=str(ok))
    assert version.content == "" and resources.text_of(version) == "z" * 70_000
    ok.write_text("changed")
    with pytest.raises(resources.ResourceError, match="changed since it was published"):
        resources.text_of(version)


def test_the_run_files_resources_are_published_once(r, run_name, tmp_path):
    (tmp_path / "shots.txt").write_text("2+2=4")
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        f'[resources]\nsystem_prompt = "answer in digits"\nshots = "file:{tmp_path}/shots.txt"\n'
    )
    config = load_config(str(run_file))
    keys = Keys(run_name)
    assert resources.publish_initial(r, keys, config.resources.named(), source="config") == [
        "system_prompt",
        "shots",
    ]
    assert resources.publish_initial(r, keys, config.resources.named(), source="config") == []  # a restart
    assert resources.get(r, keys, "shots", 1).content == "2+2=4"
    bad = tmp_path / "bad.toml"
    bad.write_text("[resources]\nsystem_prompt = 3\n")
    with pytest.raises(Exception, match="resources.system_prompt: must be text"):
        load_config(str(bad))


def test_staleness_counts_promotions_not_candidates():
    def group(pin: list[int], rolled_out: bool = False) -> Group:
        return Group("g", "s", "train", 0, 1, 0, 0.0, {}, rolled_out=rolled_out, resources={"p": pin})

    current = {"p": (7, 3)}  # version 7 is the third promotion; versions 2..6 were candidates
    assert admission.resource_lag([group([1, 1])], current) == 2
    assert admission.resource_lag([group([5, 3])], current) == 0
    assert admission.resource_lag([group([1, 1], rolled_out=True)], current) == 0  # held, not rolling out


def _wait(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.timeout(120)
def test_resources_reach_agents_and_each_attempt_records_its_version(r, redis_url, run_name, tmp_path):
    """Function and command agents get the pinned version; a prompt published mid-run reaches
    the groups dispatched after it, and every trajectory names the version it ran with."""
    keys = Keys(run_name)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "sleep": 0.5} for i in range(12)])
    run_file = tmp_path / "run.toml"
    run_file.write_text('[resources]\nsystem_prompt = "prompt v1"\n')
    procs = Procs(redis_url, run_name, tmp_path, SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED="false",
                  SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS="1", SQUALL_SCHEDULER__VAL_FRACTION="0")  # fmt: skip
    try:
        procs.start("runner", "--config", str(run_file), "--agent", "resource_agents:version_reward",
                    "--concurrency", "2")  # fmt: skip
        sched = procs.start(
            "scheduler", "--config", str(run_file), "--dataset", str(data), "--group-size", "2"
        )
        _wait(lambda: len(trajectories(r, run_name)) >= 4, 60, "the first attempts")
        # Hot change: the text's suffix lets the agent check it got the version it was pinned to.
        resources.publish(r, keys, "system_prompt", "prompt v2", source="test")
        assert sched.wait(90) == 0, log_of(sched)[-3000:]
    finally:
        procs.stop_all()
    done = trajectories(r, run_name)
    assert len(done) == 24 and all(t.status == "ok" for t in done), [t.error for t in done if t.error]
    assert all(t.reward == t.resources["system_prompt"] for t in done)
    seen = [t.resources["system_prompt"] for t in sorted(done, key=lambda t: t.finished_at)]
    assert seen[0] == 1 and seen[-1] == 2 and seen == sorted(seen), seen  # changed mid-run, never back

    # A command agent: each text in AGENT_RESOURCE_<NAME>, all of them in AGENT_RESOURCES_FILE.
    run2 = run_name + "c"
    cmd = (
        "python3 -c \"import json,os; d=json.load(open(os.environ['AGENT_RESOURCES_FILE'])); "
        "assert os.environ['AGENT_RESOURCE_SYSTEM_PROMPT'] == d['system_prompt']['text'] == 'be brief'; "
        "print(d['system_prompt']['version'] + 10)\""
    )
    resources.publish(r, Keys(run2), "system_prompt", "be brief")
    procs = Procs(redis_url, run2, tmp_path, SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED="false",
                  SQUALL_SCHEDULER__VAL_FRACTION="0")  # fmt: skip
    try:
        procs.start("runner", "--agent-cmd", cmd, "--concurrency", "2")
        sched = procs.start("scheduler", "--dataset", str(write_jsonl(tmp_path / "e.jsonl", [{"id": 0}])),
                            "--group-size", "2")  # fmt: skip
        assert sched.wait(60) == 0, log_of(sched)[-3000:]
    finally:
        procs.stop_all()
    done = trajectories(r, run2)
    assert [(t.status, t.reward, t.resources) for t in done] == [("ok", 11.0, {"system_prompt": 1})] * 2, [
        t.error for t in done
    ]
    assert json.loads(r.hget(Keys(run2).resources_current, "system_prompt")) == {
        "version": 1,
        "generation": 1,
    }


def test_trimming_waits_for_the_optimizers_group_where_it_exists(r, run_name):
    """Trajectories the trainer and scheduler acknowledged stay while the optimiser has not read
    them; a run without an optimiser trims as before."""
    from squall.scheduler.trimming import Trimmer
    from squall.shared import bus
    from squall.shared.keys import GROUP_OPTIMIZER, GROUP_SCHEDULER, GROUP_TRAINER

    keys = Keys(run_name)
    for group in (GROUP_TRAINER, GROUP_SCHEDULER):
        bus.ensure_group(r, keys.trajectories, group)
    ids = [r.xadd(keys.trajectories, {"m": b"x"}) for _ in range(3)]

    def read_all(group: str) -> None:
        r.xreadgroup(group, "c", {keys.trajectories: ">"}, count=10)
        r.xack(keys.trajectories, group, *ids)

    bus.ensure_group(r, keys.trajectories, GROUP_OPTIMIZER)
    read_all(GROUP_TRAINER)
    read_all(GROUP_SCHEDULER)
    trimmer = Trimmer(r, keys, 0.0, log=None)
    assert trimmer.trim()[keys.trajectories] == 0 and r.xlen(keys.trajectories) == 3
    read_all(GROUP_OPTIMIZER)
    assert trimmer.trim()[keys.trajectories] == 3
    # Without the optimiser's group, the other two decide alone.
    other = Keys(run_name + "b")
    for group in (GROUP_TRAINER, GROUP_SCHEDULER):
        bus.ensure_group(r, other.trajectories, group)
    ids = [r.xadd(other.trajectories, {"m": b"x"}) for _ in range(2)]
    for group in (GROUP_TRAINER, GROUP_SCHEDULER):
        r.xreadgroup(group, "c", {other.trajectories: ">"}, count=10)
        r.xack(other.trajectories, group, *ids)
    assert Trimmer(r, other, 0.0, log=None).trim()[other.trajectories] == 2
