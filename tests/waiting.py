"""Bounded polling for tests: every wait has a deadline, and passing it names what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = "a condition", interval: float = 0.05
) -> Any:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def reap(proc: Any) -> None:
    """Kill a child process that is still running and wait for it: a test's `finally`."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
