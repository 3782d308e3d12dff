"""tests/optional.py: a skipped optional suite is named, with its reason, in a closing section of
every pytest run; a required one fails instead. Checked on a real inner pytest run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

INNER = """
from optional import installed, need

def test_needs_a_missing_tool():
    need("demo-suite", installed("no_such_package_xyz"), "no_such_package_xyz is not installed (pip install it)")

def test_needs_it_too():
    need("demo-suite", False, "no_such_package_xyz is not installed (pip install it)")

def test_present_tool():
    need("other-suite", installed("pytest"), "pytest is missing")
"""


def inner_pytest(tmp_path: Path, required: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom optional import pytest_terminal_summary\n"
    )
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "SQUALL_REQUIRE_SUITES": required}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip


def test_skipped_suites_are_summed_up_with_their_reason(tmp_path):
    done = inner_pytest(tmp_path, "")
    assert done.returncode == 0, done.stdout
    section = done.stdout.split("optional suites", 1)[1]
    assert (
        "SKIPPED suite 'demo-suite' (2 tests): no_such_package_xyz is not installed (pip install it)"
        in section
    ), done.stdout
    assert "other-suite" not in section and "SQUALL_REQUIRE_SUITES=name" in section


def test_a_required_suite_fails_instead_of_skipping(tmp_path):
    done = inner_pytest(tmp_path, "demo-suite")
    assert done.returncode == 1, done.stdout
    assert "2 failed, 1 passed" in done.stdout, done.stdout
    assert "the demo-suite suite is required here (SQUALL_REQUIRE_SUITES)" in done.stdout
    assert "no optional suite was skipped" in done.stdout
