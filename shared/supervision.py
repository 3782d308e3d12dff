"""Child processes that never outlive their parent, and stopping them within a grace period.

Every service that starts children (`squall up`'s services, the local Redis server, the tool
pool's rq workers and their work horses, the sandbox's Python) uses these two parts:

- `die_with_parent(sig)`: run in the child (a `preexec_fn`, or right after `fork`); asks the
  Linux kernel to send `sig` to it when its parent exits (`PR_SET_PDEATHSIG`), so even
  `kill -9` of the parent leaves no orphan. Each caller picks the signal: SIGTERM where the
  child should shut down cleanly (Redis writes its AOF), SIGKILL where nothing is worth saving.
- `stop(processes, grace_s)`: SIGTERM to each, one shared deadline for all of them, SIGKILL
  to whatever is left (to its whole process group with `kill_group`), and the exit codes.
  SIGTERM goes to the child alone: it decides how to pass it on (rq's worker lets its work
  horse finish the job; a horse signalled directly would die mid-job).

PDEATHSIG is Linux-only: with `required=False` a system without `prctl` is skipped quietly
(callers then also stop their children explicitly); with `required=True` it is an OSError.
The signal is cleared when the child changes credentials, so a child that calls `setresuid`
must call `die_with_parent` after it (see toolpool/sandbox.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # prctl option number (linux/prctl.h)
KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for the kernel to reap a child


def die_with_parent(sig: int = signal.SIGKILL, *, required: bool = True) -> None:
    """Have the kernel send `sig` to this process when its parent exits (call it in the child)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        if required:
            raise OSError("PR_SET_PDEATHSIG needs Linux's prctl, which this system lacks") from None
        return
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0 and required:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def stop(
    processes: Sequence[subprocess.Popen], grace_s: float, *, kill_group: bool = False
) -> list[int | None]:
    """SIGTERM each running process, wait until all have exited or `grace_s` has passed, then
    SIGKILL the rest (each one's whole process group with `kill_group`: the child must lead its
    own group). Returns the exit codes in order (None only for a process the kernel did not
    reap within KILL_WAIT_S of its SIGKILL)."""
    for proc in processes:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM, group=False)
    end = time.monotonic() + grace_s
    return [_wait_or_kill(proc, end, kill_group) for proc in processes]


def _wait_or_kill(proc: subprocess.Popen, end: float, group: bool) -> int | None:
    try:
        return proc.wait(timeout=max(end - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL, group)
    try:
        return proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        return None


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass  # it exited between the check and the signal
