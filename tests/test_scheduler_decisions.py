"""The scheduler's decisions as pure functions: admission, outcomes, validation rounds, the
end of the run, Control, standby and heartbeat pruning. No Redis."""

from __future__ import annotations

import random

import msgspec
import pytest

from squall.scheduler import admission, control, validation
from squall.scheduler.cursor import Cursor
from squall.scheduler.groups import Group
from squall.scheduler.leader import classify_others
from squall.scheduler.outcomes import FAILED_STATUSES, Outcome, decide_outcome, holds
from squall.scheduler.trimming import HEARTBEAT_PRUNE_AFTER_S, long_dead
from squall.shared import schemas
from squall.shared.heartbeat import STALE_AFTER_S


def group(version=0, mode="train", rolled_out=False, size=2, attempts=None, done=None, gid="g0"):
    return Group(group_id=gid, sample_id="s", mode=mode, version=version, size=size, epoch=0, created=0.0,
                 payload={}, attempts=attempts or [0] * size, done=done or [False] * size,
                 rewards=[None] * size, rolled_out=rolled_out)  # fmt: skip


def traj(index=0, attempt=0, status="ok", reward=1.0, gid="g0"):
    return schemas.Trajectory(run="t", task_id=f"{gid}:{index}", group_id=gid, sample_id="s", index=index,
                              group_size=2, attempt=attempt, runner_id="me", status=status,
                              reward=reward if status == "ok" else None)  # fmt: skip


# --- admission --------------------------------------------------------------------------
ADMISSION = [
    # (groups as (version, mode, rolled_out), trainer version, max_inflight, max_staleness, admitted)
    ([], 0, 1, 0, True),
    ([(0, "train", False)], 0, 1, 0, False),  # full
    ([(0, "train", False)], 0, 2, 0, True),
    ([(0, "val", False)] * 5, 0, 1, 0, True),  # validation groups never count
    ([(0, "train", False)], 1, 4, 1, True),  # 1 version behind: within max_staleness 1
    ([(0, "train", False)], 2, 4, 1, False),  # 2 behind: too stale
    ([(0, "train", True)], 2, 4, 1, True),  # regression: a held (rolled-out) group never blocks
    ([(0, "train", True), (1, "train", False)], 2, 4, 1, True),
    ([(0, "train", True), (0, "train", False)], 2, 4, 1, False),
    ([(0, "train", True)] * 4, 9, 4, 1, False),  # but held groups do fill max_inflight
]


@pytest.mark.parametrize(("specs", "version", "inflight", "staleness", "expected"), ADMISSION)
def test_admission_table(specs, version, inflight, staleness, expected):
    groups = [group(v, m, rolled) for v, m, rolled in specs]
    assert admission.admits(groups, version, inflight, staleness) is expected


def reference_admits(groups, version, max_inflight, max_staleness):
    """Admission written the plain way: count, then look at every rolling group's age."""
    in_flight = 0
    for g in groups:
        if g.mode == "train":
            in_flight += 1
    if in_flight >= max_inflight:
        return False
    for g in groups:
        if g.mode == "train" and not g.rolled_out and version - g.version > max_staleness:
            return False
    return True


@pytest.mark.parametrize("seed", range(5))
def test_admission_matches_the_reference_on_random_groups(seed):
    rng = random.Random(seed)
    for _ in range(500):
        groups = [group(rng.randint(0, 6), rng.choice(["train", "train", "val"]), rng.random() < 0.3)
                  for _ in range(rng.randint(0, 8))]  # fmt: skip
        version, inflight, staleness = rng.randint(0, 8), rng.randint(1, 8), rng.randint(0, 3)
        got = admission.admits(groups, version, inflight, staleness)
        assert got == reference_admits(groups, version, inflight, staleness), (groups, version)


def test_limits_in_force():
    assert admission.inflight_limit(8, 0, False, 16) == 8  # not held: the config's
    assert admission.inflight_limit(8, 3, False, 16) == 3  # a Control override
    assert admission.inflight_limit(8, 3, True, 16) == 16  # held: at least one trainer step's worth
    assert admission.staleness_limit(1, -1) == 1 and admission.staleness_limit(1, 0) == 0


@pytest.mark.parametrize(
    ("samples", "max_samples", "epoch", "epochs", "rows", "expected"),
    [(0, 0, 0, 1, 5, False), (5, 5, 0, 1, 5, True), (4, 5, 1, 1, 5, True), (0, 0, 0, 1, 0, True),
     (9, 0, 1, 2, 5, False)],
)  # fmt: skip
def test_exhausted(samples, max_samples, epoch, epochs, rows, expected):
    got = admission.exhausted(
        samples=samples, max_samples=max_samples, epoch=epoch, epochs=epochs, train_rows=rows
    )
    assert got is expected


def test_finished():
    rolling, held = group(rolled_out=False), group(rolled_out=True)
    assert admission.finished([], draining=False, exhausted=True, end_owed=False)
    assert admission.finished([held], draining=False, exhausted=True, end_owed=False)  # the trainer's
    assert not admission.finished([rolling], draining=False, exhausted=True, end_owed=False)
    assert not admission.finished([], draining=False, exhausted=False, end_owed=False)
    assert not admission.finished([], draining=False, exhausted=True, end_owed=True)  # trainer or round owed
    assert admission.finished([held], draining=True, exhausted=False, end_owed=True)  # drain: at once
    assert not admission.finished([rolling], draining=True, exhausted=False, end_owed=False)
    assert admission.train_rolled_out([held, group(mode="val", rolled_out=False)])
    assert not admission.train_rolled_out([held, rolling])


# --- outcomes ---------------------------------------------------------------------------
OUTCOMES = [
    # (group attempts, done, trajectory (index, attempt, status), max_attempts, outcome)
    ([0, 0], [False, False], (0, 0, "ok"), 3, Outcome.RECORD_OK),
    ([0, 0], [False, False], (1, 0, "failed"), 3, Outcome.RETRY),
    ([0, 1], [False, False], (1, 1, "timeout"), 3, Outcome.RETRY),
    ([0, 2], [False, False], (1, 2, "timeout"), 3, Outcome.GIVE_UP),  # the last of 3 tries
    ([0, 0], [False, False], (0, 0, "cancelled"), 1, Outcome.GIVE_UP),
    ([0, 1], [False, False], (1, 0, "ok"), 3, Outcome.DUPLICATE),  # superseded by attempt 1
    ([0, 0], [True, False], (0, 0, "ok"), 3, Outcome.DUPLICATE),  # a repeated delivery
    ([0, 0], [True, False], (0, 0, "failed"), 3, Outcome.DUPLICATE),
    ([0, 0], [False, False], (2, 0, "ok"), 3, Outcome.DUPLICATE),  # no such member
    ([0, 0], [False, False], (-1, 0, "ok"), 3, Outcome.DUPLICATE),
]


@pytest.mark.parametrize(("attempts", "done", "t", "max_attempts", "expected"), OUTCOMES)
def test_outcome_table(attempts, done, t, max_attempts, expected):
    index, attempt, status = t
    assert (
        decide_outcome(group(attempts=attempts, done=done), traj(index, attempt, status), max_attempts)
        is expected
    )


def test_a_closed_group_makes_every_trajectory_a_duplicate():
    for status in ("ok", "failed"):
        assert decide_outcome(None, traj(status=status), 3) is Outcome.DUPLICATE


def test_failed_statuses_come_from_the_ledger_table():
    assert set(FAILED_STATUSES) == {"failed", "timeout", "cancelled"}


def test_only_complete_train_groups_are_held():
    complete = group(done=[True, True])
    assert holds(complete, True) and not holds(complete, False)
    assert not holds(group(done=[True, False]), True)
    assert not holds(group(mode="val", done=[True, True]), True)


# --- validation -------------------------------------------------------------------------
VAL_ROUNDS = [
    # (val_every, has_val, round_open, last_val_version, version, due)
    (0, True, False, -1, 0, False),  # validation off
    (2, False, False, -1, 0, False),  # no validation data
    (2, True, False, -1, 0, True),  # the first round at once
    (2, True, True, -1, 0, False),  # one round at a time
    (2, True, False, 0, 1, False),
    (2, True, False, 0, 2, True),  # every 2 versions
]


@pytest.mark.parametrize(("every", "has_val", "open_", "last", "version", "due"), VAL_ROUNDS)
def test_validation_round_due(every, has_val, open_, last, version, due):
    got = validation.val_round_due(val_every=every, has_val=has_val, round_open=open_, last_val_version=last,
                                   version=version)  # fmt: skip
    assert got is due


END_ROUNDS = [
    # (val_at_end, round_open, last_val_version, end_version, owed, due)
    (True, False, 3, None, True, False),  # the trainer's last version is not known yet: wait
    (True, False, 3, 5, True, True),  # known: one round on it
    (True, True, 3, 5, True, False),  # after the round still open
    (True, False, 5, 5, False, False),  # a round already measured that very version: once
    (False, False, 3, 5, False, False),  # no end round asked for: only the trainer's answer is owed
    (False, False, 3, None, True, False),
]


@pytest.mark.parametrize(("at_end", "open_", "last", "end", "owed", "due"), END_ROUNDS)
def test_end_round_only_on_the_trainers_last_version(at_end, open_, last, end, owed, due):
    common = dict(val_at_end=at_end, val_every=2, has_val=True, last_val_version=last, end_version=end)
    assert validation.end_owed(**common) is owed
    assert validation.end_round_due(**common, round_open=open_) is due
    assert validation.round_open([group(mode="val")]) and not validation.round_open([group()])


# --- control, standby, pruning ----------------------------------------------------------
def test_control_actions_change_the_cursor():
    cursor = Cursor()

    def act(action, **limits):
        control.apply_action(cursor, schemas.Control(run="t", action=action, limits=limits))

    act("pause")
    assert cursor.paused == 1
    act("drain")
    act("resume")
    assert (cursor.paused, cursor.draining) == (0, 0)
    act("limits", max_inflight_groups=0, max_staleness=-3)  # clamped to what admission can use
    assert (cursor.max_inflight_groups, cursor.max_staleness) == (1, 0)


def beat(service, instance, age, now=1000.0):
    return (f"{service}:{instance}", schemas.Heartbeat(run="t", service=service, instance=instance,
                                                       time=now - age), "")  # fmt: skip


def test_standby_sees_live_stale_and_dead_schedulers():
    alive_pids = {11}
    beats = [beat("scheduler", "me-1", 0), beat("runner", "r1", 0), beat("scheduler", "far-5", 3),
             beat("scheduler", "here-11", 30), beat("scheduler", "here-12", 0), ("scheduler:odd", None, "bad")]  # fmt: skip
    found = classify_others(beats, "scheduler:me-1", "here", 1000.0, 10.0, lambda pid: pid in alive_pids)
    assert found.live == "scheduler:far-5"  # fresh heartbeat on another host
    assert found.dead == ("scheduler:here-12",)  # this host, process gone: dead at once
    assert found.maybe  # here-11 is stale but its process exists: it may wake up
    alone = classify_others([beat("scheduler", "me-1", 0)], "scheduler:me-1", "here", 1000.0, 10.0, bool)
    assert (alone.live, alone.maybe, alone.dead) == (None, False, ())
    name, fresh, _ = beat("scheduler", "far-6", 0)
    stopped = (name, msgspec.structs.replace(fresh, stopped=fresh.time), "")  # exited cleanly a moment ago
    after = classify_others([stopped], "scheduler:me-1", "here", 1000.0, 10.0, bool)
    assert (after.live, after.maybe, after.dead) == (None, False, ())  # no leader to wait for


def test_long_dead_heartbeats_are_pruned_and_live_or_unreadable_ones_kept():
    assert HEARTBEAT_PRUNE_AFTER_S >= 10 * STALE_AFTER_S
    beats = [beat("runner", "gone", HEARTBEAT_PRUNE_AFTER_S + 1), beat("runner", "slow", STALE_AFTER_S + 1),
             beat("trainer", "t", 0), ("runner:junk", None, "not JSON")]  # fmt: skip
    assert long_dead(beats, 1000.0, HEARTBEAT_PRUNE_AFTER_S) == ["runner:gone"]
