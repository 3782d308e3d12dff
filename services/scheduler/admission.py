"""Admission: may one more training group go out now? Pure functions of the open groups.

Two limits, both against the trainer's weight version:
- `max_inflight_groups`: training groups open at once (held groups count, see below);
- `max_staleness`: no group is dispatched while a group still rolling out was dispatched
  more than this many versions ago.

A rolled-out group held for the trainer (`hold_until_trained`) counts against the first limit
(that is what keeps rollouts from outrunning a slow trainer) but not against the second: it
only waits for one more step's worth of groups (or is filtered as stale there), so counting it
would block exactly the dispatch that step waits for.
"""

from __future__ import annotations

from collections.abc import Iterable

from .groups import Group


def inflight_limit(configured: int, override: int, hold_until_trained: bool, groups_per_step: int) -> int:
    """The in-flight limit in force: a Control override (0: none) or the config's.

    Held groups wait for a trainer step; fewer than one step's worth would deadlock.
    """
    limit = override or configured
    return max(limit, groups_per_step) if hold_until_trained else limit


def staleness_limit(configured: int, override: int) -> int:
    """The staleness limit in force: a Control override (-1: none) or the config's."""
    return override if override >= 0 else configured


def admits(groups: Iterable[Group], version: int, max_inflight: int, max_staleness: int) -> bool:
    """May one more training group go out at trainer `version`?"""
    train = [g for g in groups if g.mode == "train"]
    if len(train) >= max_inflight:
        return False
    oldest = min((g.version for g in train if not g.rolled_out), default=version)
    return version - oldest <= max_staleness


def exhausted(*, samples: int, max_samples: int, epoch: int, epochs: int, train_rows: int) -> bool:
    """No more training samples to dispatch: the sample cap, the last epoch, or no data."""
    if max_samples and samples >= max_samples:
        return True
    return epoch >= epochs or not train_rows


def finished(groups: Iterable[Group], *, draining: bool, exhausted: bool, end_owed: bool) -> bool:
    """The run is over for the scheduler: nothing more goes out and no group is rolling out.

    Held groups (rolled out, waiting for the trainer) are the trainer's and do not count.
    Draining stops at once; otherwise the end may still be owed something: the trainer's last
    version (it trains what it holds) and the validation round on it (validation.end_owed).
    """
    rolling = any(not g.rolled_out for g in groups)
    if draining:
        return not rolling
    return exhausted and not rolling and not end_owed


def train_rolled_out(groups: Iterable[Group]) -> bool:
    """Every training group dispatched has rolled out: all its trajectories are on the stream."""
    return all(g.rolled_out for g in groups if g.mode == "train")
