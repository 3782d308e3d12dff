"""When the trainer writes a checkpoint, and how it resumes past versions it never checkpointed.

A model + optimizer checkpoint of a 135M model is 1.6 GB; writing one per optimizer step costs
more than the step on CPU. With `trainer.checkpoint_every` = K (steps) and/or
`trainer.checkpoint_every_s` (seconds), steps in between are *deferred*: their stream entries
stay in the consumer group's pending list, unacked and without ledger moves, until the
checkpoint that holds their effect is durable (bookkeeping's *next commit* simply spans several
steps). A crash in between loses those steps' updates, the restart re-reads the pending entries
and trains them again from the last checkpoint: nothing lost, nothing in the final weights twice.

A checkpoint is still forced when the trainer stops (SIGTERM, max_steps, end of data), and when
the stream has been quiet for `checkpoint_idle_s` with work uncommitted: with
`scheduler.hold_until_trained` the scheduler may be waiting for exactly those acks and ledger
moves before it dispatches more, so waiting for the next step could wait forever.

Versions published between checkpoints are served by inference nodes but are not in any
checkpoint. After a crash the restarted trainer continues from an older state, so it must not
reuse their numbers for other weights: `resume_version` moves its version past the newest one
announced, and the restored weights are published under that new number.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .checkpoint import TrainerState


class CheckpointCadence:
    """Counts steps and seconds since the last checkpoint; says when the next one is due."""

    def __init__(
        self,
        every_steps: int,
        every_s: float = 0.0,
        idle_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_steps, self.every_s, self.idle_s = every_steps, every_s, idle_s
        self.clock = clock
        self.steps_since = 0  # optimizer steps not in any checkpoint yet
        self.last_at = clock()
        self.quiet_since: float | None = None  # first of the current run of empty reads

    def stepped(self) -> None:
        self.steps_since += 1

    def checkpointed(self) -> None:
        self.steps_since, self.last_at = 0, self.clock()

    def due_after_step(self) -> bool:
        """A step was just taken: checkpoint now? (every_steps reached, or every_s passed)."""
        if self.steps_since >= self.every_steps:
            return True
        return self.every_s > 0 and self.clock() - self.last_at >= self.every_s

    def read(self, got_entries: bool) -> None:
        """After every read: an empty one starts (or continues) a quiet spell."""
        if got_entries:
            self.quiet_since = None
        elif self.quiet_since is None:
            self.quiet_since = self.clock()

    def due_when_quiet(self) -> bool:
        """After an empty read, with work uncommitted: checkpoint now? Yes when no step is
        deferred (filtered or late members only: nothing in the model to lose), when every_s
        passed, or when reads have come back empty for idle_s (the scheduler may be waiting for
        our acks before it dispatches more)."""
        if self.steps_since == 0:
            return True
        now = self.clock()
        if self.every_s > 0 and now - self.last_at >= self.every_s:
            return True
        return self.quiet_since is not None and now - self.quiet_since >= self.idle_s


def resume_version(state: TrainerState, published: int | None) -> bool:
    """After a restart: when a newer version than the checkpoint's was announced (published
    between checkpoints, then lost to a crash), give the restored weights the next free number
    so that one number never names two sets of weights. True when the version moved (the caller
    publishes the restored weights under it)."""
    if published is None or published <= state.version:
        return False  # the checkpoint holds the announced version (or one not announced yet)
    state.version = published + 1
    state.version_step = state.step
    return True
