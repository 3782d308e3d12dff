"""scripts/offline_wheels.py: a wheelhouse that installs squall with no index on a bare interpreter.

The target here is a fresh venv of this machine's Python with nothing in it, standing in for an
offline node; the wheels come from PyPI (like `make real-model`, this needs the network).
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/offline_wheels.py"
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

pytestmark = pytest.mark.slow


def build_wheelhouse(out: Path, *options: str) -> subprocess.CompletedProcess:
    # squall's core only (no extras): the ML stack is what a GPU node brings
    return subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out",
            str(out),
            "--python-version",
            PYTHON_VERSION,
            "--extras",
            "",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=True).create(folder)
    return folder / "bin/python"


def install(wheelhouse: Path, site: Path, python: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(wheelhouse / "install.sh"), str(site), str(python)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_wheelhouse_installs_squall_on_a_bare_interpreter(tmp_path, bare_python):
    built = build_wheelhouse(tmp_path / "wheels")
    assert built.returncode == 0, built.stderr
    assert "offline_wheels:" in built.stdout
    wheels = {path.name.split("-")[0].lower() for path in (tmp_path / "wheels").glob("*.whl")}
    assert {"squall", "redis", "msgspec", "fastapi"} <= wheels

    installed = install(tmp_path / "wheels", tmp_path / "site", bare_python)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "dependencies met" in installed.stdout

    # the console module imports with nothing but the interpreter's stdlib and the wheelhouse
    imported = subprocess.run(
        [str(bare_python), "-c", "import squall.cli, squall.scheduler.cli, squall.runner.cli; print('ok')"],
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.stdout.strip() == "ok", imported.stderr


def test_a_dependency_skipped_but_missing_on_the_target_is_named(tmp_path, bare_python):
    built = build_wheelhouse(tmp_path / "wheels", "--skip", "msgspec")
    assert built.returncode == 0, built.stderr
    assert "msgspec" in (tmp_path / "wheels/left-out.txt").read_text()

    installed = install(tmp_path / "wheels", tmp_path / "site", bare_python)
    assert installed.returncode == 1
    assert "msgspec" in installed.stdout and "misses a dependency" in installed.stdout
