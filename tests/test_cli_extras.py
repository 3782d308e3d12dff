"""Every `squall X` answers --help; a missing optional library is one line naming the extra.

The "missing" library is really missing for the child process: a sitecustomize.py on its
PYTHONPATH puts a finder first on sys.meta_path that refuses the blocked top-level names, so
`import torch` fails there exactly as it does in an install without the extra.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from squall.cli import COMMANDS, NEEDS
from squall.shared.extras import EXTRA_OF

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import os, sys

_BLOCKED = set(filter(None, os.environ.get("SQUALL_TEST_BLOCK", "").split(",")))


class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
"""

# The modules a core command runs (beyond its CLI module): they must import with no extra installed.
CORE_RUN_MODULES = [
    "squall.runner.runner",
    "squall.runner.gateway",
    "squall.runner.agents",
    "squall.scheduler.scheduler",
    "squall.monitor.status",
    "squall.monitor.dashboard",
    "squall.monitor.acl",
    "squall.toolpool.pool",
    "squall.toolpool.http",
    "squall.toolpool.client",
    "squall.monitor.peek",
    "squall.local.init",
    "squall.local.redis_cmd",
]


def run_squall(args: list[str], tmp_path: Path, blocked: list[str] = ()) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "SQUALL_TEST_BLOCK": ",".join(blocked)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )


def _dist_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_extras_table_names_real_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert extra in extras, f"{module}: extra {extra!r} is not in pyproject.toml"
        dists = [_dist_name(req) for req in extras[extra]]
        wanted = module.replace("_", "-")
        assert any(d.startswith(wanted) for d in dists), f"{module}: extra {extra!r} lists {dists}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_help(command, tmp_path):
    done = run_squall(["-m", "squall.cli", command, "--help"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: squall {command}"), done.stdout[:200]


# Arguments that get past argparse, so that the command reaches its library check.
_ARGS = {"export": ["out", "--version", "1"], "model": ["import", "model.gguf", "out"]}


@pytest.mark.parametrize("command", sorted(NEEDS))
def test_missing_extra_is_one_line(command, tmp_path):
    module = NEEDS[command][-1]
    done = run_squall(["-m", "squall.cli", command, *_ARGS.get(command, [])], tmp_path, blocked=[module])
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"squall {command} needs {module}: pip install 'squall[{EXTRA_OF[module]}]'"], (
        done.stderr
    )
    assert "Traceback" not in done.stderr


def test_later_missing_library_is_one_line(tmp_path):
    """A library a config choice pulls in (here matplotlib, behind `squall up`'s curve) is
    reported the same way when its import fails after the command started."""
    (tmp_path / "cmd.py").write_text(
        "import argparse\n"
        "def add_arguments(parser: argparse.ArgumentParser) -> None: pass\n"
        "def main(args) -> int:\n"
        "    import matplotlib.pyplot  # noqa: F401\n"
        "    return 0\n"
    )
    code = (
        "import sys; from squall import cli; "
        "cli.COMMANDS['probe'] = ('cmd', 'probe'); sys.exit(cli.main(['probe']))"
    )
    done = run_squall(["-c", code], tmp_path, blocked=["matplotlib"])
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == "squall probe needs matplotlib: pip install 'squall[data]'"


def test_unrelated_missing_module_still_raises(tmp_path):
    (tmp_path / "cmd.py").write_text(
        "def add_arguments(parser): pass\ndef main(args):\n    import no_such_module_squall  # noqa: F401\n"
    )
    code = "import sys; from squall import cli; cli.COMMANDS['probe'] = ('cmd', 'probe'); sys.exit(cli.main(['probe']))"
    done = run_squall(["-c", code], tmp_path)
    assert done.returncode != 0
    assert "ModuleNotFoundError" in done.stderr and "no_such_module_squall" in done.stderr


def test_core_commands_need_no_extra(tmp_path):
    """runner, scheduler, status, dashboard, acl, worker, peek, init and redis run on a core
    install: their modules import with every optional library blocked."""
    code = (
        "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ok')\n"
    )
    done = run_squall(["-c", code, *CORE_RUN_MODULES], tmp_path, blocked=sorted(EXTRA_OF))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
