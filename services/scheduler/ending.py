"""The end of the data, the scheduler's side of shared/dataend.py.

`Ending` tells the trainer once no training group is coming, decides which version the end
round measures (the trainer's answer; without one, after `end_wait_s` or when no trainer can
answer, the newest published version), and says when the inference nodes serve it. The
owner decides when to call each (see Scheduler.step and Scheduler.maybe_validate).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis

from squall.shared import dataend
from squall.shared.config import SchedulerSection
from squall.shared.heartbeat import read_heartbeats, state_of
from squall.shared.keys import Keys
from squall.shared.roles import DEFAULT_ROLE, node_field

from . import report
from .groups import Group


class Ending:
    def __init__(self, r: redis.Redis, keys: Keys, section: SchedulerSection, log) -> None:
        self.r, self.keys, self.section, self.log = r, keys, section, log
        self.told = False  # this process announced (or found announced) the end of the data

    def announce(self, samples: int, groups: Iterable[Group]) -> None:
        """No training group is coming: tell the trainer (once per run; Event `data_end`)."""
        if self.told:
            return
        if dataend.announce_data_end(self.r, self.keys, samples):
            held = sum(g.mode == "train" for g in groups)
            report.event(self.r, self.keys, "data_end", samples=samples, held_groups=held)
            self.log.info("data_end", samples=samples, held_groups=held)
        self.told = True

    def version(self, newest: int, groups: Iterable[Group]) -> int | None:
        """The version the end round measures: the trainer's last one once it has answered;
        None while it may still be training what it holds. With no trainer to wait for, or
        past `end_wait_s`, `newest` (the newest published one; Event `end_unconfirmed`)."""
        end = dataend.read(self.r, self.keys)
        if end.scheduler_at is None or end.end_version is not None:
            return end.end_version
        waited = time.time() - end.scheduler_at
        expected = self._trainer_expected(groups)
        if expected and waited < self.section.end_wait_s:
            return None
        dataend.settle_unconfirmed(self.r, self.keys, newest)
        reason = (
            f"no answer from the trainer within end_wait_s={self.section.end_wait_s:g}"
            if expected
            else "no trainer to wait for"
        )
        report.event(
            self.r, self.keys, "end_unconfirmed", version=newest, reason=reason, waited_s=round(waited, 1)
        )
        level = self.log.warning if expected else self.log.info  # no trainer: a rollout-only run
        level("end_unconfirmed", version=newest, reason=reason, waited_s=round(waited, 1))
        return newest

    def served(self, version: int) -> bool:
        """Do the inference nodes serve `version` yet? Every live plain follower (heartbeat stat
        `follows_newest`) must have acknowledged it in `versions`, or the end round would be
        answered by older weights; snapshot nodes never will. Past `end_wait_s` after the end
        was settled, the round goes out anyway (Event `end_round_nodes_behind`). In a run with
        trained roles a node serves a version per role, each in its own field: every role's
        final version (`trainer_version:<role>` of the handshake) must be served."""
        versions = self.r.hgetall(self.keys.versions)
        wanted = self._wanted(version)
        behind = []
        for _field, beat, _ in read_heartbeats(self.r, self.keys):
            if beat is None or beat.service != "inference" or state_of(beat) != "alive":
                continue
            serves = {
                role: int(versions.get(node_field(beat.instance, role).encode(), -1)) for role in wanted
            }
            if beat.stats.get("follows_newest", 1.0) and any(serves[role] < v for role, v in wanted.items()):
                behind.append(beat.instance)
        if not behind:
            return True
        end = dataend.read(self.r, self.keys)
        settled = end.trainer_at or end.scheduler_at or time.time()
        if time.time() - settled < self.section.end_wait_s:
            return False
        report.event(self.r, self.keys, "end_round_nodes_behind", version=version, nodes=behind)
        self.log.warning("end_round_nodes_behind", version=version, nodes=behind)
        return True

    def _wanted(self, version: int) -> dict[str, int]:
        """Role -> the version a node must serve of it: each trained role's final version once
        the roles answered, else `version` of the default role (the node's own field)."""
        return dataend.role_answers(self.r.hgetall(self.keys.data_end)) or {DEFAULT_ROLE: version}

    def _trainer_expected(self, groups: Iterable[Group]) -> bool:
        """Is an answer worth waiting for? A trainer beats, or died (it may be restarted); or,
        with no trainer heartbeat at all, training groups are held for one. A trainer that
        stopped cleanly answers nothing more."""
        beats = [beat for name, beat, _ in read_heartbeats(self.r, self.keys) if name.startswith("trainer:")]
        if beats:
            return any(state_of(beat) != "stopped" for beat in beats)
        return any(g.mode == "train" for g in groups)
