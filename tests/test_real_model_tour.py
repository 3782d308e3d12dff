"""examples/real_model_tour.py: every example's run file, with the tour's real-model overrides,
is a valid run config (a renamed field would fail the tour only after minutes of setup), and
its table reads a summary as `squall up` writes it."""

from __future__ import annotations

import pytest

from examples.real_model_tour import EXAMPLES, REAL_MODEL, real_model_settings, summary_fields, table
from squall.shared.config import load_config


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.name)
def test_each_example_with_the_real_model_overrides_is_a_valid_run(example):
    config = load_config(example.config, env=real_model_settings(example, val_samples=16))
    assert config.model.path == REAL_MODEL and config.trainer.lora_rank == 16
    assert config.scheduler.val_samples == 16 and config.scheduler.attempt_timeout_s == 300
    assert config.inference.tool_parser == "smollm2" and config.run.dir == f"runs/real-{example.name}"


def test_the_table_reads_a_summary():
    summary = {"val_reward_start": 0.4375, "val_reward_end": 0.65625, "val_reward_end_version": 16, "steps": 18,
               "minutes": 5.3, "train_curve": [{"version": 0, "mean": 0.75}],
               "ledger": {"dispatched": 8, "trained": 8}, "ledger_balanced": True}  # fmt: skip
    row = {"example": "werewolf", "exit": 0, **summary_fields(summary)}
    line = table([row]).splitlines()[-1]
    assert (
        line == "| werewolf | 0.438 | 0.656 (16) | 0.750 | 18 | 5.300 | dispatched 8, trained 8 | True | 0 |"
    )
    assert "| - | - (-) |" in table([{"example": "sql", "exit": 1, **summary_fields({})}])
