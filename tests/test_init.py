"""`squall init`: run.toml generated from the config models (every section and field, each
documented, commented-out defaults that parse back to the defaults), the scaffold's files, and
a short `squall up` of the scaffold as it is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from squall.local import init
from squall.shared.config import RunConfig, Section
from squall.shared.errors import ConfigError
from squall.shared.localredis import free_port

ROOT = Path(__file__).resolve().parents[1]
FIELD_LINE = re.compile(r"^(# )?([a-z_]+) = (.*)$")


def parse_fields(text: str) -> dict[str, dict[str, tuple[bool, str]]]:
    """section -> field -> (set?, value text), from the lines `field = v` and `# field = v`."""
    sections: dict[str, dict[str, tuple[bool, str]]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections[current] = {}
        elif (match := FIELD_LINE.match(line)) and current:
            assert match.group(2) not in sections[current], f"{current}.{match.group(2)} twice"
            sections[current][match.group(2)] = (match.group(1) is None, match.group(3))
    return sections


def _table_sections() -> dict[str, type]:
    """RunConfig's sections that are one table each (not maps of named tables like [roles.NAME])."""
    return {
        name: info.annotation
        for name, info in RunConfig.model_fields.items()
        if isinstance(info.annotation, type)
    }


def test_run_file_lists_every_section_and_field_with_its_docstring(tmp_path):
    values = init.run_values("r1", "/models/p")
    text = init.render_run_file(values, init.HEADER)
    fields = parse_fields(text)
    assert list(fields) == list(RunConfig.model_fields)
    lines = text.splitlines()
    for section, model in _table_sections().items():
        assert set(fields[section]) == set(model.model_fields), section
        docs = init.field_docs(model)
        for name in model.model_fields:
            at = next(i for i, line in enumerate(lines) if FIELD_LINE.match(line) and
                      FIELD_LINE.match(line).group(2) == name and i > lines.index(f"[{section}]"))  # fmt: skip
            above = []
            for line in reversed(lines[:at]):
                if FIELD_LINE.match(line) or not line.startswith("#"):
                    break
                above.insert(0, line[2:])
            assert docs[name] and " ".join(above).startswith(docs[name]), (section, name, above)
    # What init sets is set; the rest is commented out.
    for section, set_fields in values.items():
        assert {name for name, (on, _) in fields[section].items() if on} == set(set_fields), section
    parsed = tomllib.loads(text)
    assert RunConfig.model_validate(parsed).model_dump() == RunConfig.model_validate(values).model_dump()


def test_commented_defaults_parse_back_to_the_defaults():
    text = init.render_run_file({})
    enabled = "\n".join(line[2:] if FIELD_LINE.match(line) else line for line in text.splitlines())
    parsed = tomllib.loads(enabled)
    assert set(parsed) == set(RunConfig.model_fields)
    assert RunConfig.model_validate(parsed) == RunConfig()
    assert sum(len(section) for section in parsed.values()) == sum(
        len(model.model_fields) for model in _table_sections().values()
    )


class Extra(Section):
    mode: Literal["fast", "safe"] = "safe"
    """How to go about it."""
    budget: float = Field(2.5, gt=0, le=10)
    """Seconds to spend, at most."""
    tags: dict[str, str] = {"a b": 'say "hi"'}
    """Free-form labels."""


def test_a_new_field_is_documented_with_its_choices_and_bounds():
    lines = init.render_section("extra", Extra, {"budget": 1e-05})
    assert lines[:2] == ["# The [extra] section.", "[extra]"]
    assert "# How to go about it. (one of: fast, safe)" in lines and '# mode = "safe"' in lines
    assert "# Seconds to spend, at most. (> 0, <= 10)" in lines and "budget = 1e-05" in lines
    assert tomllib.loads("\n".join(lines[1:]).replace('# tags = ', 'tags = '))["extra"] == {
        "budget": 1e-05, "tags": {"a b": 'say "hi"'}
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"\[extra\] has no field\(s\) \['speed'\]"):
        init.render_section("extra", Extra, {"speed": 1})


def test_scaffold_writes_the_folder_and_refuses_to_overwrite(tmp_path):
    folder = tmp_path / "My Run!"
    run_file = init.scaffold(folder, train=5, val=3)
    cfg = tomllib.loads(run_file.read_text())
    assert cfg["run"]["name"] == "My-Run" and cfg["model"]["path"] == str(init.demo_policy())
    assert (Path(cfg["model"]["path"]) / "config.json").is_file()
    rows = [json.loads(line) for line in (folder / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and {"question", "answer"} <= set(rows[0])
    assert (
        len((folder / "data" / "val.jsonl").read_text().splitlines()) == 3 == cfg["scheduler"]["val_samples"]
    )
    agent = (folder / "agent.py").read_text()
    assert (
        "async def agent(task" in agent
        and "from openai import AsyncOpenAI" in agent
        and "squall"
        not in (
            agent.split('"""', 2)[2]  # the code after the module docstring does not import squall
        )
    )
    compile(agent, "agent.py", "exec")
    with pytest.raises(ConfigError, match="already exist.*--force"):
        init.scaffold(folder)
    init.scaffold(folder, train=2, force=True)
    assert len((folder / "data" / "train.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ConfigError, match=r"run\.name"):
        init.scaffold(tmp_path / "x", name="bad name!")


def test_cli_lists_init_and_reports_a_refusal(tmp_path):
    env = {**os.environ, "PYTHONPATH": ""}
    listing = subprocess.run([sys.executable, "-m", "squall.cli", "--help"], capture_output=True, text=True,
                             env=env, check=True).stdout  # fmt: skip
    assert re.search(r"^\s+init\s+write a run folder", listing, re.M), listing
    first = subprocess.run([sys.executable, "-m", "squall.cli", "init", str(tmp_path / "f"), "--train", "3"],
                           capture_output=True, text=True, env=env)  # fmt: skip
    assert first.returncode == 0 and "squall up --config run.toml" in first.stdout, first.stderr
    again = subprocess.run([sys.executable, "-m", "squall.cli", "init", str(tmp_path / "f")],
                           capture_output=True, text=True, env=env)  # fmt: skip
    assert again.returncode == 2 and "pass --force" in again.stderr


@pytest.mark.slow
@pytest.mark.redis
def test_init_then_up_runs_the_scaffold_as_it_is(tmp_path):
    folder = tmp_path / "demo"
    subprocess.run([sys.executable, "-m", "squall.cli", "init", str(folder)], check=True, capture_output=True)
    env = {
        **os.environ,
        "SQUALL_RUN__REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # a private embedded Redis
        # A short run: 8 groups of 8, 4 at a time, so the second 4 wait for the trainer's first step.
        "SQUALL_SCHEDULER__MAX_SAMPLES": "8",
        "SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS": "4",
        "SQUALL_SCHEDULER__VAL_SAMPLES": "4",
    }
    done = subprocess.run(
        [sys.executable, "-m", "squall.cli", "up", "--config", "run.toml", "--minutes", "3"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "scheduler finished the dataset" in out and "unclean exits" not in out, out[-3000:]
    summary = json.loads((folder / "out" / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["ledger_balanced"] and not {"pending", "running"} & set(ledger), ledger
    consumed = ledger.get("trained", 0) + sum(v for k, v in ledger.items() if k.startswith("filtered"))
    assert consumed >= 4 * 8 and summary["steps"] >= 1, summary
    assert summary["val_curve"] and len(summary["train_curve"]) == 8, summary


@pytest.mark.realmodel
def test_init_with_a_real_model_picks_settings_from_it(tmp_path, real_model):
    from squall.shared.config import load_config

    run_file = init.scaffold(tmp_path / "run", model=str(real_model), train=4, val=2)
    config = load_config(str(run_file), env={})
    assert config.trainer.lr == 2e-6 and config.trainer.gradient_checkpointing
    assert config.inference.max_model_len == 4096 == config.trainer.max_seq_len  # 8192 capped
    # the attempt's deadline counts from its start, not from dispatch; dispatch only bounds queueing
    assert config.scheduler.attempt_timeout_s == 300.0 and config.scheduler.task_timeout_s == 1800.0
    assert (config.trainer.checkpoint_every, config.trainer.checkpoint_every_s) == (4, 300.0)
    assert init.model_settings(init.demo_policy()) == {}  # the tiny policy keeps the demo's settings
