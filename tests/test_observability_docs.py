"""docs/observability.md is checked against the code: every command and flag it shows exists,
every config key it names is a field, every metric it names is exported, every file it links is
there."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

from squall.cli import COMMANDS
from squall.shared.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "observability.md").read_text()


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"squall {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser


def test_every_command_and_flag_shown_exists():
    shown = re.findall(r"^squall ([a-z]+)(.*)$", "\n".join(re.findall(r"```bash\n(.*?)```", DOC, re.S)), re.M)
    shown += re.findall(r"`squall ([a-z]+)([^`]*)`", DOC)
    assert {c for c, _ in shown} >= {"status", "peek", "show", "rescore"}
    for command, rest in shown:
        assert command in COMMANDS, command
        options = {o for a in _parser(command)._actions for o in a.option_strings}
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
            assert flag in options, f"squall {command} has no {flag}"


def test_every_config_key_named_is_a_field():
    for section, name in set(re.findall(r"`(alerts|scheduler|tracking|trainer|model|run)\.([a-z_]+)`", DOC)):
        model = type(getattr(RunConfig(), section))
        assert name in model.model_fields, f"{section}.{name}"
    assert set(re.findall(r"`alerts\.([a-z_]+)`", DOC)) == set(type(RunConfig().alerts).model_fields)


def test_every_metric_and_file_named_exists():
    code = "\n".join(p.read_text() for p in (ROOT / "services").rglob("*.py"))
    for metric in set(re.findall(r"\b(squall_[a-z_]+?)(?:_total)?\b", DOC)):
        assert f'"{metric}"' in code, metric
    for link in re.findall(r"\]\((\.\./[^)#]+)\)", DOC):
        assert (ROOT / "docs" / link).resolve().exists(), link
    for path in re.findall(r"(deploy/prometheus/[a-z_]+\.yml)", DOC):
        assert (ROOT / path).exists(), path
