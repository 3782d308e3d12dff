"""Leadership: one scheduler leads a run; others stand by until its heartbeat goes stale.

A scheduler takes the lead by bumping the leader epoch (field `leader_epoch` of the cursor
hash) and checks it every step: one that finds a newer epoch (it was paused, and a standby
took over) stops at once and stands by. Other schedulers are seen through their heartbeats
(`scheduler:<host>-<pid>`): younger than `standby_after_s` means alive; a heartbeat from this
host whose process is gone means dead for sure (a local restart after kill -9 need not wait);
anything else stale is presumed dead, but a merely paused process could wake up, so the new
leader gives it two polls to notice the new epoch before it loads the state.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from squall.shared import schemas
from squall.shared.heartbeat import read_heartbeats
from squall.shared.keys import Keys

from .cursor import LEADER_FIELD

STANDBY_POLL_S = 0.5  # how often a standby looks at the other schedulers' heartbeats


@dataclass(frozen=True)
class Others:
    """What this scheduler knows about the other schedulers of the run."""

    live: str | None  # a live other scheduler's heartbeat field (None: none)
    maybe: bool  # some other one may still be around (a stale heartbeat of a foreign process)
    dead: tuple[str, ...]  # heartbeat fields of processes of this host that are gone


def classify_others(
    beats: list[tuple[str, schemas.Heartbeat | None, str]],
    own_field: str,
    host: str,
    now: float,
    standby_after_s: float,
    pid_alive: Callable[[int], bool],
) -> Others:
    """Sort the other schedulers' heartbeats into live, maybe-alive and certainly dead."""
    live, maybe, dead = None, False, []
    for name, beat, _error in beats:
        if not name.startswith("scheduler:") or name == own_field:
            continue
        other_host, _, pid = name.removeprefix("scheduler:").rpartition("-")
        if other_host == host and pid.isdigit() and not pid_alive(int(pid)):
            dead.append(name)
            continue
        if beat is not None and beat.stopped:
            continue  # exited cleanly: neither leading nor about to
        age = now - beat.time if beat is not None else float("inf")
        if age < standby_after_s:
            live = name
        maybe = True
    return Others(live, maybe, tuple(dead))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class Leadership:
    """The leader epoch this scheduler holds (`token`) and the standby wait before taking it."""

    def __init__(
        self, r: redis.Redis, keys: Keys, own_field: str, standby_after_s: float, poll_s: float, log
    ):
        self.r, self.keys, self.own_field, self.log = r, keys, own_field, log
        self.standby_after_s, self.poll_s = standby_after_s, poll_s
        self.token: int | None = None  # leader epoch once acquire() took the lead (None: not checked)

    def is_leader(self) -> bool:
        """Still the newest scheduler to take the lead? (Always true before acquire().)"""
        if self.token is None:
            return True
        return int(self.r.hget(self.keys.scheduler_state, LEADER_FIELD) or 0) == self.token

    def others(self) -> Others:
        beats = read_heartbeats(self.r, self.keys)
        found = classify_others(
            beats, self.own_field, socket.gethostname(), time.time(), self.standby_after_s, pid_alive
        )
        if found.dead:
            self.r.hdel(self.keys.heartbeats, *found.dead)
        return found

    def acquire(self, stopped: Callable[[], bool], announce: Callable[[], None]) -> bool:
        """Stand by while another scheduler is alive, then take the lead: bump the epoch,
        `announce` (a heartbeat), give a possibly paused former leader time to see the new
        epoch. False when stopped meanwhile or another scheduler took the lead first."""
        others = self.others()
        if others.live:
            self.log.info("scheduler_standby", leader=others.live, takes_over_after_s=self.standby_after_s)
        while others.live:
            if stopped():
                return False
            time.sleep(STANDBY_POLL_S)
            others = self.others()
        self.token = int(self.r.hincrby(self.keys.scheduler_state, LEADER_FIELD, 1))
        announce()
        if others.maybe:
            time.sleep(2 * self.poll_s + 0.2)  # a former leader checks the epoch every step
            return self.is_leader()
        return True
