"""Admission: may one more training group go out now? Pure functions of the open groups.

Two limits, both against the trainer's weight version (with several trained roles, the
staleness limit against each role's own version):
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

    Held groups wait for a trainer step (and its checkpoint: pass groups_per_step times
    trainer.checkpoint_every); fewer than that would deadlock.
    """
    limit = override or configured
    return max(limit, groups_per_step) if hold_until_trained else limit


def staleness_limit(configured: int, override: int) -> int:
    """The staleness limit in force: a Control override (-1: none) or the config's."""
    return override if override >= 0 else configured


def admits(
    groups: Iterable[Group],
    version: int,
    max_inflight: int,
    max_staleness: int,
    role_versions: dict[str, int] | None = None,
) -> bool:
    """May one more training group go out at trainer `version`? With several trained roles
    (`role_versions`: each role's version now), the staleness limit holds for every role on
    its own: no role may have moved more than `max_staleness` versions past the version it had
    when the oldest group still rolling out was dispatched."""
    train = [g for g in groups if g.mode == "train"]
    if len(train) >= max_inflight:
        return False
    rolling = [g for g in train if not g.rolled_out]
    if role_versions:
        return all(
            now - min((g.role_versions.get(role, now) for g in rolling), default=now) <= max_staleness
            for role, now in role_versions.items()
        )
    oldest = min((g.version for g in rolling), default=version)
    return version - oldest <= max_staleness


def resource_lag(groups: Iterable[Group], current: dict[str, tuple[int, int]]) -> int:
    """Promotions of a resource (shared/resources.py) that the oldest pin of a training group
    still rolling out is behind: a new prompt makes groups stale as a new weight version does."""
    lags = [
        current[name][1] - pin[1]
        for g in groups
        if g.mode == "train" and not g.rolled_out
        for name, pin in g.resources.items()
        if name in current
    ]
    return max(lags, default=0)


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
