"""Optional suites: skip when their tool is missing on a developer's machine, fail in CI.

A suite named in SQUALL_REQUIRE_SUITES (comma-separated; `.ci/run` sets it for the suites CI
installs) must run: a missing tool there fails the test instead of hiding it as a skip.
A third-party package is looked up with `find_spec`, never imported here, so an import error
inside our own code (or a broken install of the package) still fails loudly where it happens.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = "SQUALL_REQUIRE_SUITES"


def required_suites() -> set[str]:
    return {name.strip() for name in os.environ.get(REQUIRE_ENV, "").split(",") if name.strip()}


def need(suite: str, available: bool, missing: str) -> None:
    """Skip (or, when `suite` is required, fail) unless `available`; `missing` says what to install."""
    if available:
        return
    if suite in required_suites():
        pytest.fail(f"the {suite} suite is required here ({REQUIRE_ENV}) but {missing}", pytrace=False)
    pytest.skip(missing)


def installed(module: str) -> bool:
    """Is the top-level package of `module` installed? (Does not import it.)"""
    return importlib.util.find_spec(module.split(".")[0]) is not None
