"""shared/supervision.py with real processes: a child given PDEATHSIG dies when its parent is
killed with -9, and `stop` SIGTERMs, waits within one deadline, then SIGKILLs (the process
alone, or its whole group)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from squall.shared.supervision import die_with_parent, stop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
# A parent that starts a grandchild with PDEATHSIG=SIGKILL, prints its pid, then waits to be killed.
PARENT = (
    "import signal, subprocess, sys, time\n"
    "from squall.shared.supervision import die_with_parent\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
    "                         preexec_fn=lambda: die_with_parent(signal.SIGKILL))\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet (PID 1 of a container may not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_until(predicate, deadline_s: float) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_child_dies_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child)
        parent.kill()
        parent.wait(10)
        assert _wait_until(lambda: _gone(child), 10.0), f"child {child} outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_die_with_parent_rejects_a_bad_signal():
    with pytest.raises(OSError, match="PR_SET_PDEATHSIG"):
        die_with_parent(10_000)  # no such signal: prctl fails with EINVAL


def _started(code: str, **popen) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **popen)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_stop_terminates_then_kills_within_one_deadline():
    polite = _started("import time; print('ready', flush=True); time.sleep(60)")
    stubborn = _started(IGNORE_TERM)
    t0 = time.monotonic()
    codes = stop([polite, stubborn, polite], grace_s=1.0)
    took = time.monotonic() - t0
    assert codes == [-signal.SIGTERM, -signal.SIGKILL, -signal.SIGTERM]
    assert 1.0 <= took < 5.0, took  # one shared grace period, not one per process


def test_stop_kills_the_whole_group_when_asked():
    # The leader of a new session ignores SIGTERM and starts a member of its group that does too.
    leader_code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"m = subprocess.Popen([sys.executable, '-c', {IGNORE_TERM!r}], stdout=subprocess.PIPE, text=True)\n"
        "m.stdout.readline(); print(m.pid, flush=True); time.sleep(60)"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", leader_code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    assert stop([leader], grace_s=0.5, kill_group=True) == [-signal.SIGKILL]
    assert _wait_until(lambda: _gone(member), 10.0), "the group's other member survived"
