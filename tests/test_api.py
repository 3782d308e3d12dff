"""squall from Python: `import squall` stays light, `squall.config` builds and validates run
configs in code, `squall.up` runs a whole run in this process and returns its result."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import squall
from squall.shared.errors import ConfigError
from squall.shared.localredis import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "calc" / "demo.toml"


def test_import_squall_loads_nothing_heavy_and_names_its_api():
    code = (
        "import sys, squall; heavy = ('pydantic', 'redis', 'torch', 'httpx', 'yaml', 'squall.');"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == []
    assert {"up", "config", "init", "RunConfig", "UpResult"} <= set(dir(squall))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        squall.nope  # noqa: B018


def test_config_from_a_file_with_sections_replaced_field_by_field():
    cfg = squall.config(DEMO, scheduler={"max_samples": 64}, trainer={"lr": 1e-4})
    assert cfg.scheduler.max_samples == 64 and cfg.trainer.lr == 1e-4
    assert cfg.scheduler.group_size == 8 and cfg.run.name == "calc-demo"  # the rest is the file's
    again = squall.config(cfg, run={"name": "other"})
    assert again.run.name == "other" and again.scheduler.max_samples == 64 and cfg.run.name == "calc-demo"


def test_config_from_a_dict_or_section_models_and_environment_left_out(monkeypatch):
    from squall.shared.config import TrainerSection

    monkeypatch.setenv("SQUALL_TRAINER__LR", "0.5")
    cfg = squall.config({"run": {"name": "nb"}}, trainer=TrainerSection(groups_per_step=2))
    assert cfg.run.name == "nb" and cfg.trainer.groups_per_step == 2
    assert cfg.trainer.lr == TrainerSection().lr  # the environment is up()'s business, as the CLI's
    cfg.trainer.lr = 3e-4  # assignments validate
    with pytest.raises(ValueError, match="greater than 0"):
        cfg.trainer.lr = -1.0


def test_config_errors_name_the_field_and_the_source_type():
    with pytest.raises(ConfigError, match=r"trainer\.lr: Input should be greater than 0"):
        squall.config(trainer={"lr": -1})
    with pytest.raises(ConfigError, match=r"scheduler\.no_such_field"):
        squall.config({"scheduler": {"no_such_field": 1}})
    with pytest.raises(ConfigError, match="not int"):
        squall.config(42)
    with pytest.raises(ConfigError, match="cannot read config file"):
        squall.config("/nonexistent/run.toml")


def test_up_rejects_an_unknown_option_listing_the_known_ones():
    with pytest.raises(ConfigError, match=r"no option 'runnerz'; known: .*minutes, runners"):
        squall.up({"run": {"name": "x"}}, runnerz=3)


def test_up_returns_a_failed_start_with_the_reason_and_the_callers_signal_handlers(tmp_path, monkeypatch):
    before = signal.getsignal(signal.SIGINT)
    port = free_port()
    cfg = {
        "run": {"name": "apifail", "dir": str(tmp_path / "run"), "redis_url": f"redis://127.0.0.1:{port}/0"}
    }
    # The environment overrides a config given in code, as it overrides a run file for the CLI:
    # a URL with a password is never started locally, so nothing answers there.
    monkeypatch.setenv("SQUALL_RUN__REDIS_URL", f"redis://:pw@127.0.0.1:{port}/0")
    result = squall.up(cfg, runners=1)
    assert result.exit_code == 1 and not result.ok and result.summary == {}
    assert result.reason.startswith("failed: no Redis answers at redis://:***@127.0.0.1"), result.reason
    assert signal.getsignal(signal.SIGINT) is before  # the caller's Ctrl-C handler is back


@pytest.mark.slow
@pytest.mark.redis
def test_up_runs_a_short_run_from_a_config_built_in_code(tmp_path, monkeypatch):
    from examples.calc.tasks import generate, write_jsonl

    write_jsonl(tmp_path / "train.jsonl", generate("train", 32, 0))
    write_jsonl(tmp_path / "val.jsonl", generate("val", 4, 0))
    monkeypatch.chdir(ROOT)  # the agent is examples.calc.agent, imported from the repo root
    cfg = squall.config(
        DEMO,
        run={"name": "apirun", "dir": str(tmp_path / "run"), "redis_url": f"redis://127.0.0.1:{free_port()}/0"},
        scheduler={"dataset": str(tmp_path / "train.jsonl"), "val_dataset": str(tmp_path / "val.jsonl"),
                   "group_size": 4, "max_inflight_groups": 4, "val_samples": 4, "val_every": 1},
        trainer={"groups_per_step": 2, "max_steps": 1},  # the run ends when the trainer has made one step
        runner={"concurrency": 8},
    )  # fmt: skip
    result = squall.up(cfg, runners=1, minutes=4, label="api")
    with pytest.raises(redis.ConnectionError):  # the embedded Redis did not outlive the call
        redis.Redis.from_url(cfg.run.redis_url, socket_connect_timeout=0.5).ping()
    assert result.ok, str(result)
    assert result.reason == "trainer reached max_steps", result.reason
    assert result.summary["steps"] == 1 and result.summary["versions"]["trainer"] == 1, result.summary
    assert result.ledger_balanced and result.ledger["dispatched"] >= 2 * 4, result.ledger
    assert len(result.train_curve) >= 2 and all(p["count"] == 4 for p in result.train_curve), (
        result.train_curve
    )
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == result.summary
    assert result.curve_png is not None and "apirun" in str(result)
