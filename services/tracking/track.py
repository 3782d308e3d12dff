"""The tracker: follows one run's streams and logs them to the configured backends.

Parts, wired here:
- sources: new `metrics` (trainer step metrics), `rewards` (train groups, validation
  rounds) and `trajectories` entries after the cursor, read with XRANGE (no consumer group),
  the ledger counts (logged once per new trainer version) and rollouts decoded to text;
- backends: one `Backend` per name in tracking.backends (wandb, tensorboard, mlflow);
- cursor: the last entry id per stream, sample counts per version and the backends' run ids,
  saved after every poll the backends flushed, so a restart neither skips nor repeats a poll.

It only reads Redis (XRANGE, HGETALL), so it can run as the read-only `monitor` ACL user.
While Redis is away it waits (shared.retry) up to run.redis_outage_s, then exits non-zero.
A crash between the backends' flush and the cursor's save repeats at most that one poll.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import redis
import structlog

from squall.shared import schemas
from squall.shared.config import RunConfig
from squall.shared.errors import ConfigError
from squall.shared.keys import Keys
from squall.shared.retry import REDIS_ERRORS, RedisOutage
from squall.shared.runstate import decode_entry, read_ledger, read_versions

from . import sources
from . import stream_cursor as cursors
from .backends import Backend, make_backend

log = structlog.get_logger()


def tracking_dir(config: RunConfig) -> Path:
    return Path(config.tracking.dir or Path(config.run.dir) / "tracking")


class Tracker:
    def __init__(self, config: RunConfig, r: redis.Redis) -> None:
        if not config.tracking.backends:
            raise ConfigError("tracking.backends is empty: list at least one of wandb, tensorboard, mlflow")
        self.config, self.r = config, r
        self.keys = Keys(config.run.name)
        self.folder = tracking_dir(config)
        self.cursor = cursors.load(self.folder, self.keys.run)
        self.text = sources.TextDecoder(config.model.path) if config.tracking.samples_per_version else None
        self.backends: list[Backend] = []
        for name in dict.fromkeys(config.tracking.backends):
            state = self.cursor.backends.setdefault(name, {})
            self.backends.append(make_backend(name, config, self.folder, state))
        self.skipped = 0  # entries that did not decode
        self.logged: dict[str, int] = defaultdict(int)  # what this process logged: kind -> count

    # --- one poll -------------------------------------------------------------------------
    def poll(self) -> dict[str, int]:
        """Log everything new since the cursor, flush the backends, save the cursor.
        Returns what this poll logged (kind -> count)."""
        counts: dict[str, int] = defaultdict(int)
        for scalars in self._metrics():
            self._log(scalars)
            counts["metrics"] += 1
        for scalars in self._rewards():
            self._log(scalars)
            counts["rewards"] += 1
        if self._ledger(force=False):
            counts["ledger"] += 1
        counts["samples"] += self._samples()
        self._commit()
        for kind, n in counts.items():
            self.logged[kind] += n
        return {kind: n for kind, n in counts.items() if n}

    def _log(self, scalars: sources.Scalars) -> None:
        if scalars.values:
            for backend in self.backends:
                backend.log_scalars(scalars.axis, scalars.step, scalars.values)

    def _read(self, stream: str, kind: type[schemas.Message]) -> list[Any]:
        """Decoded messages of `stream` after the cursor (which moves past them, and past
        entries that did not decode)."""
        out = []
        for entry_id, fields in sources.entries_after(
            self.r, self.keys.stream_names()[stream], self.cursor.last_id(stream)
        ):
            message = decode_entry(fields, kind)
            if message is None:
                self.skipped += 1
            else:
                out.append(message)
            self.cursor.ids[stream] = entry_id
        return out

    def _metrics(self) -> list[sources.Scalars]:
        return [sources.metrics_scalars(m) for m in self._read("metrics", schemas.Metrics)]

    def _rewards(self) -> list[sources.Scalars]:
        return [sources.reward_scalars(p) for p in self._read("rewards", schemas.RewardPoint)]

    def _ledger(self, *, force: bool) -> bool:
        """Log the ledger counts once per new trainer version (or, with `force`, whenever they
        changed since last logged: the final counts at shutdown)."""
        version = read_versions(self.r, self.keys).trainer
        if version is None:
            return False
        counts = read_ledger(self.r, self.keys).with_dispatched()
        if version > self.cursor.ledger_version or (force and counts != self.cursor.ledger_counts):
            self._log(sources.ledger_scalars(version, counts))
            self.cursor.ledger_version, self.cursor.ledger_counts = version, counts
            return True
        return False

    def _samples(self) -> int:
        """Decode up to samples_per_version new trajectories per policy version and log them."""
        quota = self.config.tracking.samples_per_version
        if not quota or self.text is None:
            return 0
        picked: dict[int, list[sources.SampleRow]] = defaultdict(list)
        for trajectory in self._read("trajectories", schemas.Trajectory):
            version = sources.policy_version(trajectory)
            if self.cursor.samples_of(version) + len(picked[version]) < quota:
                picked[version].append(sources.sample_row(trajectory, self.text))
        total = 0
        for version, rows in sorted(picked.items()):
            if rows:
                for backend in self.backends:
                    backend.log_samples(version, rows)
                self.cursor.add_samples(version, len(rows))
                total += len(rows)
        return total

    def _commit(self) -> None:
        for backend in self.backends:
            backend.flush()
        cursors.save(self.folder, self.cursor)

    # --- lifecycle ------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Poll every tracking.poll_s until `stop`, then a last poll (and the final ledger)."""
        outage = RedisOutage(self.config.run.redis_url, deadline_s=self.config.run.redis_outage_s, log=log)
        while True:
            stopping = stop.wait(self.config.tracking.poll_s)
            try:
                self.poll()
                if stopping:
                    if self._ledger(force=True):
                        self._commit()
                    return
            except REDIS_ERRORS as exc:
                outage.wait(self.r, exc, "track_poll")

    def close(self) -> None:
        errors = []
        for backend in self.backends:
            try:
                backend.close()
            except Exception as exc:  # close the others all the same, then report
                errors.append(f"{backend.name}: {exc}")
        log.info(
            "tracker_stopped", backends=[b.name for b in self.backends], skipped=self.skipped, **self.logged
        )
        if errors:
            raise RuntimeError(f"tracking backends failed to close: {'; '.join(errors)}")


def run(config: RunConfig) -> int:
    import signal

    from squall.shared.redisconn import connect

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    r = connect(config.run.redis_url, autostart=False)
    started = time.monotonic()
    tracker = Tracker(config, r)
    log.info(
        "tracker_started",
        backends=list(config.tracking.backends),
        dir=str(tracker.folder),
        cursor=tracker.cursor.ids,
        start_s=round(time.monotonic() - started, 3),
    )
    try:
        tracker.run(stop)
    finally:
        tracker.close()
    return 0
