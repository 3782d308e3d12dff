"""Docs that cannot drift: the README's key table, every documented `squall` command and flag,
and every link between docs are checked against the code and the tree."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from squall.cli import COMMANDS
from squall.shared import schemas
from squall.shared.keys import Keys

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = "RUN"


def _key_rows() -> dict[str, str]:
    """README's key table: the key in a row's first cell -> the whole row."""
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        match = re.match(r"\| `(squall:\{run\}:[^`]+)` \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def _documented(key: str) -> str:
    return key.replace(f"squall:{RUN}:", "squall:{run}:")


KEY_PROPERTIES = sorted(name for name, value in vars(Keys).items() if isinstance(value, property))


@pytest.mark.parametrize("name", KEY_PROPERTIES)
def test_every_key_and_its_fields_are_in_the_readme_table(name):
    rows = _key_rows()
    key = _documented(getattr(Keys(RUN), name))
    assert key in rows, f"shared/keys.py has Keys.{name} = {key!r}; README's key table has no row for it"
    # Every name keys.py quotes for this key (hash fields, groups) is in its row too.
    for quoted in re.findall(r"`([^`]+)`", getattr(Keys, name).__doc__ or ""):
        assert quoted in rows[key], f"Keys.{name}'s docstring names `{quoted}`; README's row lacks it"


def test_the_tool_queues_are_in_the_readme_table():
    assert _documented(Keys(RUN).tool_queue("<tool>")) in _key_rows()


def test_the_attempt_key_is_spelled_as_the_code_builds_it():
    task = schemas.Task(
        run="r",
        task_id="g12:3",
        group_id="g12",
        sample_id="s",
        index=3,
        group_size=8,
        payload={},
        deadline=1.0,
    )
    row = _key_rows()[_documented(Keys(RUN).attempts)]
    assert f"HGET squall:{{run}}:attempts {task.key}" in row
    separator = task.key[len(task.task_id)]
    assert f"`task_id{separator}attempt`" in row and f"task_id{separator}attempt" in Keys.attempts.__doc__


def test_shared_imports_itself_relatively():
    """README: inside shared/ imports are relative (mypy checks shared/ as a unit)."""
    for path in sorted((ROOT / "shared").glob("*.py")):
        absolute = re.findall(r"^\s*(?:from|import) squall\.shared\b.*$", path.read_text(), flags=re.M)
        assert not absolute, f"{path.name}: {absolute}"


# --- commands and flags ---------------------------------------------------------------------

_SHELL_LINE = re.compile(r"(?:^|[\s`(])(?:\S*/)?squall(?:\.cli)? ([a-z][a-z-]*)([^`]*)")


def _command_lines() -> list[tuple[str, str, str]]:
    """(doc, command, rest of the line) for every `squall COMMAND ...` in a code block or span."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        snippets = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        without_blocks = re.sub(r"```.*?```", "", text, flags=re.S)
        snippets += re.findall(r"`([^`\n]+)`", without_blocks)
        for snippet in snippets:
            for line in snippet.splitlines():
                line = re.split(r"\s#\s|\s&&\s|\s\|\s|;\s", line)[0]
                for command, rest in _SHELL_LINE.findall(line):
                    found.append((doc.relative_to(ROOT).as_posix(), command, rest))
    return found


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"squall {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser


def test_docs_name_squall_commands_at_all():
    assert len({command for _, command, _ in _command_lines()}) >= 8  # the scanner sees the docs


def test_every_documented_command_and_flag_exists():
    problems = []
    parsers: dict[str, argparse.ArgumentParser] = {}
    for doc, command, rest in _command_lines():
        if command not in COMMANDS:
            problems.append(f"{doc}: `squall {command}` is not a command (known: {sorted(COMMANDS)})")
            continue
        parser = parsers.setdefault(command, _parser(command))
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            if flag not in parser._option_string_actions:
                problems.append(f"{doc}: `squall {command} {flag}`: no such flag")
    assert not problems, "\n".join(problems)


# --- links ----------------------------------------------------------------------------------


def test_every_link_between_docs_resolves():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_every_code_path_a_doc_names_exists():
    """Paths in code spans that point into the tree (`services/...`, `docs/...`) exist."""
    missing = []
    pattern = r"`((?:services|shared|docs|deploy|examples|benchmarks|tests|scripts)/[\w./-]+\.\w+)`"
    for doc in DOCS:
        for target in re.findall(pattern, doc.read_text()):
            if "<" in target or "*" in target:
                continue
            if not (ROOT / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, "\n".join(missing)
