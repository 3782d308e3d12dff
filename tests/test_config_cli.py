"""Config validation, the `squall` command, `squall redis` and `squall peek`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from squall.shared import bus, schemas
from squall.shared.config import load_config
from squall.shared.errors import ConfigError
from squall.shared.keys import Keys
from squall.shared.localredis import free_port

SQUALL = [sys.executable, "-m", "squall.cli"]


def test_file_then_env_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[run]\nname = "exp1"\n[trainer]\nlr = 3e-4\ngroups_per_step = 2\n')
    env = {"SQUALL_TRAINER__LR": "1e-3", "SQUALL_RUNNER__INFERENCE_URLS": '["http://a:1", "http://b:2"]'}
    config = load_config(path, env=env, overrides={"trainer": {"groups_per_step": 8}})
    assert config.run.name == "exp1"
    assert config.trainer.lr == 1e-3
    assert config.trainer.groups_per_step == 8
    assert config.runner.inference_urls == ["http://a:1", "http://b:2"]


def test_yaml_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("scheduler:\n  group_size: 8\n")
    assert load_config(path, env={}).scheduler.group_size == 8


@pytest.mark.parametrize(
    ("text", "env", "field"),
    [
        ("[trainer]\nlr = -1\n", {}, "trainer.lr"),
        ("[trainer]\nlearning_rate = 1\n", {}, "trainer.learning_rate"),
        ("[scheduler]\ngroup_size = 'four'\n", {}, "scheduler.group_size"),
        ("", {"SQUALL_INFERENCE__BACKEND": "tensorrt"}, "inference.backend"),
        ("[run]\nname = 'has space'\n", {}, "run.name"),
    ],
)
def test_bad_values_name_the_field(tmp_path, text, env, field):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(path, env=env)


def test_environment_overrides_every_kind_of_field_and_names_a_bad_variable():
    env = {
        "SQUALL_RUN__NAME": "envrun",
        "SQUALL_SCHEDULER__SHUFFLE": "false",
        "SQUALL_INFERENCE__SNAPSHOTS": '{"opponent": 0}',
        "SQUALL_TRAINER__DEVICE": "123",  # a string field keeps a numeric-looking value as text
        "SQUALL_WORKER_SLOT": "3",  # other SQUALL_ variables (no __) are not config
    }
    config = load_config(env=env)
    assert (config.run.name, config.scheduler.shuffle) == ("envrun", False)
    assert config.inference.snapshots == {"opponent": 0} and config.trainer.device == "123"
    with pytest.raises(ConfigError, match="SQUALL_TRAINNER__LR: no config section 'trainner'"):
        load_config(env={"SQUALL_TRAINNER__LR": "1"})
    with pytest.raises(ConfigError, match="SQUALL_RUNNER__INFERENCE_URLS: 'http://a:1' is not valid JSON"):
        load_config(env={"SQUALL_RUNNER__INFERENCE_URLS": "http://a:1"})


@pytest.mark.parametrize(
    ("section", "new"), [("scheduler", "max_dispatch_lag"), ("trainer", "max_sample_age")]
)
def test_the_old_max_staleness_still_loads_with_a_warning(tmp_path, section, new):
    path = tmp_path / "run.toml"
    path.write_text(f"[{section}]\nmax_staleness = 3\n")
    with pytest.warns(
        FutureWarning, match=rf"{section}\.max_staleness is deprecated: call it {section}\.{new}"
    ):
        config = load_config(path, env={})
    assert getattr(getattr(config, section), new) == 3
    env = {f"SQUALL_{section.upper()}__MAX_STALENESS": "5"}
    with pytest.warns(FutureWarning):
        assert getattr(getattr(load_config(env=env), section), new) == 5
    path.write_text(f"[{section}]\nmax_staleness = 3\n{new} = 2\n")
    with pytest.raises(ConfigError, match=f"give only {new}"):
        load_config(path, env={})


def test_unparseable_file_is_a_config_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="not valid toml"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", env={})


def test_help_is_fast_and_imports_nothing_heavy():
    start = time.perf_counter()
    out = subprocess.run(SQUALL + ["--help"], capture_output=True, text=True, check=True)
    assert time.perf_counter() - start < 2.0  # includes interpreter start; README reports the real figure
    assert "peek" in out.stdout and "redis" in out.stdout
    probe = "import sys, squall.cli; squall.cli.main(['--help']); print(sorted(m for m in ('torch','fastapi','redis','transformers') if m in sys.modules))"
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert shown.strip().endswith("[]")


def test_squall_redis_serves_and_leaves_no_orphan(tmp_path):
    port = free_port()
    parent = subprocess.Popen(SQUALL + ["redis", "--port", str(port), "--dir", str(tmp_path), "--aof"])
    client = redis.Redis(port=port)
    end = time.monotonic() + 15
    while time.monotonic() < end:
        try:
            if client.ping():
                break
        except redis.ConnectionError:
            time.sleep(0.1)
    client.set("k", "v")
    # kill -9 the parent: the server must go with it (PR_SET_PDEATHSIG), never orphaned.
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)
    end = time.monotonic() + 10
    alive = True
    while alive and time.monotonic() < end:
        try:
            client.ping()
            time.sleep(0.1)
        except redis.ConnectionError:
            alive = False
    assert not alive, "redis server outlived its parent"
    assert (tmp_path / "appendonlydir").exists() or list(tmp_path.glob("*.aof"))


@pytest.mark.redis
def test_peek_prints_decoded_json(r, redis_url, run_name):
    keys = Keys(run_name)
    task = schemas.Task(run=run_name, task_id="g:0", group_id="g", sample_id="s", index=0, group_size=2,
                        payload={"q": "2+2"}, deadline=1e10)  # fmt: skip
    bus.publish(r, keys.tasks, task)
    r.xadd(keys.tasks, {schemas.ENTRY_FIELD: b"\xc1"})
    out = subprocess.run(SQUALL + ["peek", "tasks", "-n", "5", "--run", run_name, "--redis-url", redis_url],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["kind"] == "task" and first["payload"] == {"q": "2+2"}
    assert "undecodable" in second
    bad = subprocess.run(
        SQUALL + ["peek", "nope", "--run", run_name, "--redis-url", redis_url], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "known are" in bad.stderr


def _parsed(module: str, argv: list[str]):
    import argparse
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    return parser, parser.parse_args(argv)


def test_field_flags_set_their_fields_over_the_environment(tmp_path, monkeypatch):
    from squall.shared.cliargs import config_from_args

    monkeypatch.setenv("SQUALL_SCHEDULER__GROUP_SIZE", "4")
    monkeypatch.setenv("SQUALL_SCHEDULER__EPOCHS", "3")
    _, args = _parsed("squall.scheduler.cli", ["--group-size", "8", "--dataset", "d.jsonl"])
    config = config_from_args(args)
    assert (config.scheduler.group_size, config.scheduler.epochs, config.scheduler.dataset) == (
        8,
        3,
        "d.jsonl",
    )
    argv = ["--no-follow", "--served-name", "pol", "--port", "8123", "--model", "/m", "--behind", "2"]
    _, args = _parsed("squall.inference.cli", argv)
    config = config_from_args(args)
    assert config.inference.follow_weights is False and config.inference.model_name == "pol"
    assert (config.inference.port, config.model.path, config.inference.behind_versions) == (8123, "/m", 2)
    _, args = _parsed("squall.runner.cli", ["--inference-url", "http://a:1", "--inference-url", "http://b:2"])
    assert config_from_args(args).runner.inference_urls == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize("module", ["squall.scheduler.cli", "squall.inference.cli", "squall.runner.cli"])
def test_field_flag_help_shows_the_models_default(module):
    from squall.shared.cliargs import FIELD_DEST, field_info

    parser, _ = _parsed(module, [])
    flags = [a for a in parser._actions if a.dest.startswith(FIELD_DEST)]
    assert flags
    for action in flags:
        field = action.dest[len(FIELD_DEST) :]
        default = field_info(field).get_default(call_default_factory=True)
        assert f"({field}; default " in action.help, action.help
        if default not in ("", [], {}, None):
            assert f"default {default!r})" in action.help, action.help
