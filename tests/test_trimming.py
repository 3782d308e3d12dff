"""Trimming, proven on a real run: a scheduler, two runners (trivial agent) and a real trainer
(a tiny model; each group's members share the row's reward, so the trainer files them as
filtered:zero_variance and acknowledges them like any other).

The scheduler trims every 0.3 s here (scheduler.trim_every_s). While the run goes on, a
watcher samples XLEN of `tasks` and `trajectories` and checks that every entry still pending
in any group can be read back: trimming removes only what every group acknowledged. At the
end every attempt was seen by both groups of `trajectories` (the trainer filtered each one;
the scheduler wrote one reward point per group), the ledger balances, and every other stream
and hash of the run is within the bound docs/operating.md gives it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import redis
from runner_helpers import Procs, log_of, write_jsonl
from test_trainer_step import make_tiny_model
from waiting import wait_for

from squall.shared.keys import GROUP_RUNNERS, GROUP_SCHEDULER, GROUP_TRAINER, Keys
from squall.shared.runstate import read_snapshot

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SAMPLES, GROUP_SIZE, EPOCHS = 40, 2, 2
ATTEMPTS = SAMPLES * GROUP_SIZE * EPOCHS  # 160, none fails
MAX_INFLIGHT_GROUPS = 4
TRIM_EVERY_S = 0.3


@dataclass
class Watch:
    """What the watcher saw: each stream's (entries added so far, length) over time, and any
    pending entry that was gone."""

    samples: dict[str, list[tuple[int, int]]] = field(
        default_factory=lambda: {"tasks": [], "trajectories": []}
    )
    lost: list[tuple[str, str, str]] = field(default_factory=list)  # (stream, group, entry id)
    checked: int = 0  # pending entries read back


def _pending_ids(r: redis.Redis, stream: str, group: str) -> list[bytes]:
    try:
        return [row["message_id"] for row in r.xpending_range(stream, group, "-", "+", 10_000)]
    except redis.ResponseError:  # the group is not created yet
        return []


def _check_pending_readable(r: redis.Redis, watch: Watch, name: str, stream: str, group: str) -> None:
    for entry_id in _pending_ids(r, stream, group):
        if r.xrange(stream, entry_id, entry_id):
            watch.checked += 1
            continue
        # Gone. Fine only if it was acknowledged meanwhile (then trimming may take it).
        still = r.xpending_range(stream, group, entry_id, entry_id, 1)
        if still:
            watch.lost.append((name, group, entry_id.decode()))


def watch_run(r: redis.Redis, keys: Keys, stop: threading.Event, watch: Watch) -> None:
    pairs = [("tasks", keys.tasks, GROUP_RUNNERS), ("trajectories", keys.trajectories, GROUP_TRAINER),
             ("trajectories", keys.trajectories, GROUP_SCHEDULER)]  # fmt: skip
    while not stop.wait(0.05):
        for name, stream in (("tasks", keys.tasks), ("trajectories", keys.trajectories)):
            if r.exists(stream):
                info = r.xinfo_stream(stream)
                watch.samples[name].append((int(info["entries-added"]), int(info["length"])))
        for name, stream, group in pairs:
            _check_pending_readable(r, watch, name, stream, group)


def trimmed_mid_run(samples: list[tuple[int, int]]) -> int:
    """Entries trimming had removed at the last sample taken before the last attempt was added
    (0: trimming waited for the end of the run)."""
    return max((added - length for added, length in samples if added < ATTEMPTS), default=0)


def changes(series: list[int]) -> list[int]:
    """The series without repeats, for a readable failure."""
    return [b for a, b in zip([None, *series], series, strict=False) if b != a]


def filtered(counts: dict[str, int]) -> int:
    """Attempts the trainer filed as filtered (each member of a group shares its reward here, so
    zero_variance; a trajectory without trained turns would be no_trained_turns)."""
    return sum(n for state, n in counts.items() if state.startswith("filtered:"))


def test_work_streams_stay_bounded_and_nothing_unacked_is_trimmed(r, redis_url, run_name, tmp_path):
    keys = Keys(run_name)
    rows = [{"id": f"s{i}", "reward": i % 2, "sleep": 0.02} for i in range(SAMPLES)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    model = make_tiny_model(tmp_path / "model")
    procs = Procs(
        redis_url, run_name, tmp_path, SQUALL_RUN__DIR=str(tmp_path / "run"), SQUALL_MODEL__PATH=str(model),
        SQUALL_TRAINER__DEVICE="cpu", SQUALL_TRAINER__GROUPS_PER_STEP="1",
        SQUALL_SCHEDULER__TRIM_EVERY_S=str(TRIM_EVERY_S),
        SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS=str(MAX_INFLIGHT_GROUPS),
    )  # fmt: skip
    watch, stop = Watch(), threading.Event()
    watcher = threading.Thread(target=watch_run, args=(redis.Redis.from_url(redis_url), keys, stop, watch))
    try:
        trainer = procs.start("trainer")
        # Wait for the model to load, so trajectories do not pile up behind a starting trainer.
        wait_for(
            lambda: read_snapshot(r, keys).alive("trainer"), timeout_s=120, what="the trainer's heartbeat"
        )
        for _ in range(2):
            procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "4")
        watcher.start()
        scheduler = procs.start(
            "scheduler", "--dataset", str(data), "--group-size", str(GROUP_SIZE), "--epochs", str(EPOCHS)
        )
        assert scheduler.wait(240) == 0, log_of(scheduler)[-3000:]
        # The trainer consumes the last groups after the scheduler finished dispatching.
        filed = lambda: filtered(read_snapshot(r, keys).ledger.counts) == ATTEMPTS  # noqa: E731
        try:
            wait_for(filed, timeout_s=60, what="the trainer to file every attempt")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {read_snapshot(r, keys).ledger}\n{log_of(trainer)[-3000:]}"
            ) from None
        assert trainer.poll() is None, log_of(trainer)[-3000:]
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(10)
        procs.stop_all()

    # Nothing unacknowledged was ever removed, and the watcher did look at pending entries.
    assert watch.lost == [], watch.lost
    assert watch.checked > 50, watch.checked
    # Both work streams were trimmed while the run went on, and stayed a fraction of what went
    # through. The stream's own counters say so (entries added minus length is what trimming
    # removed); the watcher's lengths alone may never see one go down, since a steady run can
    # trim between any two samples and hold the same length at each.
    for name, stream in (("tasks", keys.tasks), ("trajectories", keys.trajectories)):
        series = [length for _, length in watch.samples[name]]
        info = r.xinfo_stream(stream)
        added, left = int(info["entries-added"]), int(info["length"])
        assert added == ATTEMPTS, (name, added)
        assert trimmed_mid_run(watch.samples[name]) >= 1, (name, watch.samples[name][-20:])
        assert max(series) <= ATTEMPTS // 3, (name, max(series), changes(series))
        assert added - left >= ATTEMPTS - ATTEMPTS // 3, (name, added, left, changes(series))

    snap = read_snapshot(r, keys, rewards=None)
    # Every attempt was seen by both groups of `trajectories` and settled.
    assert snap.ledger.balanced and snap.ledger.dispatched == ATTEMPTS, snap.ledger
    assert filtered(snap.ledger.counts) == sum(snap.ledger.counts.values()) == ATTEMPTS, snap.ledger
    assert len(snap.train_rewards) == SAMPLES * EPOCHS  # one point per group: the scheduler saw each member
    for group in snap.groups:
        assert group.pending == 0 and group.lag == 0, group
    # The rest of the run is bounded by construction (docs/operating.md, "What grows").
    assert snap.open_groups <= MAX_INFLIGHT_GROUPS  # held until trained; released by a running scheduler
    assert len(snap.processes) <= 4  # scheduler, trainer, 2 runners; the stopped ones removed theirs
    assert set(snap.versions.raw) <= {"trainer"}
    assert int(r.hlen(keys.attempts)) == ATTEMPTS  # the ledger's detail: one field per attempt
