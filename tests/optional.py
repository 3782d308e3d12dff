"""Optional suites: skip when their tool is missing on a developer's machine, fail in CI.

A suite named in SQUALL_REQUIRE_SUITES (comma-separated; `.ci/run` sets it for the suites CI
installs) must run: a missing tool there fails the test instead of hiding it as a skip.
A third-party package is looked up with `find_spec`, never imported here, so an import error
inside our own code (or a broken install of the package) still fails loudly where it happens.

A skip says which suite it belongs to (`optional suite 'browser': chromium is not installed`),
and `pytest_terminal_summary` (registered by conftest.py) closes every run with the optional
suites that were skipped, how many tests each, and why, so a skip is never silent.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections import defaultdict
from typing import Any

import pytest

REQUIRE_ENV = "SQUALL_REQUIRE_SUITES"
SKIP_PREFIX = re.compile(r"^(?:Skipped: )?optional suite '(?P<suite>[^']+)': (?P<why>.*)$", re.S)


def required_suites() -> set[str]:
    return {name.strip() for name in os.environ.get(REQUIRE_ENV, "").split(",") if name.strip()}


def need(suite: str, available: bool, missing: str) -> None:
    """Skip (or, when `suite` is required, fail) unless `available`; `missing` says what to install."""
    if available:
        return
    if suite in required_suites():
        pytest.fail(f"the {suite} suite is required here ({REQUIRE_ENV}) but {missing}", pytrace=False)
    pytest.skip(f"optional suite {suite!r}: {missing}")


def installed(module: str) -> bool:
    """Is the top-level package of `module` installed? (Does not import it.)"""
    return importlib.util.find_spec(module.split(".")[0]) is not None


def skipped_suites(reports: list[Any]) -> dict[str, dict[str, int]]:
    """suite -> reason -> tests skipped for it, from pytest's skip reports."""
    found: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for report in reports:
        longrepr = getattr(report, "longrepr", None)
        message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        match = SKIP_PREFIX.match(message.strip())
        if match:
            found[match["suite"]][match["why"].strip()] += 1
    return {suite: dict(reasons) for suite, reasons in found.items()}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """A closing section: every optional suite that skipped, with its test count and reason."""
    skipped = terminalreporter.stats.get("skipped", [])
    suites = skipped_suites(skipped)
    write = terminalreporter.write_line
    terminalreporter.section("optional suites")
    if not suites:
        write("no optional suite was skipped")
    for suite, reasons in sorted(suites.items()):
        for why, count in sorted(reasons.items()):
            write(f"SKIPPED suite {suite!r} ({count} test{'s' if count != 1 else ''}): {why}")
    others = len(skipped) - sum(sum(r.values()) for r in suites.values())
    if others:
        write(f"{others} other skipped test(s): their reasons are in the short test summary (-ra)")
    if suites:
        write(f"to make a suite required (a missing tool fails instead of skipping): {REQUIRE_ENV}=name,...")


def need_verl() -> None:
    """The verl backend's tests: they run in `make test-verl`'s virtualenv, which has verl."""
    need(
        "verl",
        installed("verl"),
        "verl is not installed here (make test-verl runs these tests in .venv-verl)",
    )


def trl_python() -> str:
    """The TRL venv's python that benchmarks/race.py starts its TRL contender with."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return os.environ.get("SQUALL_TRL_PYTHON") or str(root / ".venv-trl" / "bin" / "python")


def need_trl() -> str:
    """The race harness's TRL contender: it runs in `make trl-venv`'s virtualenv (TRL pins packages
    of its own); `make test-race` builds it and runs these tests. Returns that venv's python."""
    import subprocess

    python = trl_python()
    available = os.path.isfile(python) and (
        subprocess.run([python, "-c", "import trl"], capture_output=True, timeout=120).returncode == 0
    )
    need(
        "race",
        available,
        f"{python} cannot import trl (make test-race builds .venv-trl and runs these tests)",
    )
    return python
