"""Every example on the real chat model: what SmolLM2-135M-Instruct scores on calc, code, search,
sql and werewolf when a user points the example's own run file at it, and whether the run goes
end to end (steps trained, ledger balanced, a clean stop).

Each example runs as written (its agent, its data, its reward), with only the model and the
settings a real model needs replaced through `SQUALL_<SECTION>__<FIELD>` variables: LoRA
adapters (rank 16, lr 4e-4, as examples/calc_real uses), 1,024-token micro-batches, attempt
deadlines that do not count queue time, a smaller held-out set so the first measurement comes
early. The model's own chat template has no tool support, so tool-using examples get the
server's generic tools block (docs/inference.md) and the SmolLM2 parser.

    make real-model
    python -m examples.real_model_tour --minutes 6                  # all five, ~35 minutes
    python -m examples.real_model_tour --only sql,code --minutes 4

One line per example, then a markdown table (docs/real_model_examples.md holds the last one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REAL_MODEL = "runs/models/smollm2-135m-instruct"


@dataclass(frozen=True)
class Example:
    name: str
    config: str
    data: list[str]  # the command that writes the example's data (from its run file's header)


EXAMPLES = [
    Example("calc", "examples/calc/demo.toml",
            ["examples.calc.tasks", "--out", "runs/calc-data", "--train", "4000", "--val", "200", "--seed", "0"]),
    Example("code", "examples/code/cpu.toml",
            ["examples.code.tasks", "--out", "runs/code-data", "--train", "2000", "--val", "200", "--seed", "0"]),
    Example("search", "examples/search/cpu.toml",
            ["examples.search.data", "--out", "runs/search-data", "--train", "1000", "--val", "100", "--seed", "0"]),
    Example("sql", "examples/sql/cpu.toml",
            ["examples.sql.data", "--out", "runs/sql-data", "--train", "500", "--val", "50", "--seed", "0"]),
    Example("werewolf", "examples/werewolf/run.toml",
            ["examples.werewolf.game", "--out", "runs/werewolf-data", "--train", "4000", "--val", "200", "--seed", "0"]),
]  # fmt: skip


def real_model_settings(example: Example, val_samples: int) -> dict[str, str]:
    """The overrides that turn an example's tiny-policy run file into a real-model run."""
    return {
        "SQUALL_MODEL__PATH": REAL_MODEL,
        "SQUALL_RUN__NAME": f"real-{example.name}",
        "SQUALL_RUN__DIR": f"runs/real-{example.name}",
        "SQUALL_TRAINER__LR": "4e-4",
        "SQUALL_TRAINER__LORA_RANK": "16",
        "SQUALL_TRAINER__LORA_ALPHA": "32",
        "SQUALL_TRAINER__GROUPS_PER_STEP": "1",
        "SQUALL_TRAINER__MAX_TOKENS_PER_MICROBATCH": "1024",
        "SQUALL_TRAINER__MAX_SEQ_LEN": "2048",
        "SQUALL_INFERENCE__MAX_MODEL_LEN": "2048",
        "SQUALL_INFERENCE__MAX_BATCH": "32",
        "SQUALL_INFERENCE__TOOL_PARSER": "smollm2",
        "SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS": "2",
        "SQUALL_SCHEDULER__VAL_SAMPLES": str(val_samples),
        "SQUALL_SCHEDULER__VAL_EVERY": "4",
        "SQUALL_SCHEDULER__TASK_TIMEOUT_S": "1800",
        "SQUALL_SCHEDULER__ATTEMPT_TIMEOUT_S": "300",
    }


def run_example(example: Example, minutes: float, val_samples: int) -> dict[str, Any]:
    python = sys.executable
    subprocess.run([python, "-m", *example.data], check=True, stdout=subprocess.DEVNULL)
    env = {**os.environ, **real_model_settings(example, val_samples)}
    log = Path(f"runs/real-{example.name}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        code = subprocess.run(
            [python, "-m", "squall.cli", "up", "--config", example.config, "--minutes", str(minutes),
             "--label", f"real-{example.name}"],
            env=env, stdout=out, stderr=subprocess.STDOUT, check=False,
        ).returncode  # fmt: skip
    summary_file = Path(f"runs/real-{example.name}/summary.json")
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return {"example": example.name, "exit": code, "log": str(log), **summary_fields(summary)}


def summary_fields(summary: dict[str, Any]) -> dict[str, Any]:
    ledger = summary.get("ledger") or {}
    return {
        "val_start": summary.get("val_reward_start"),
        "val_end": summary.get("val_reward_end"),
        "val_end_version": summary.get("val_reward_end_version"),
        "steps": summary.get("steps"),
        "minutes": summary.get("minutes"),
        "train_reward_first": _first_train_reward(summary),
        "ledger": ledger,
        "balanced": summary.get("ledger_balanced"),
    }


def _first_train_reward(summary: dict[str, Any]) -> float | None:
    train = summary.get("train_curve") or []
    return train[0]["mean"] if train else None


def fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| example | held-out at start | held-out at end (version) | train reward, first step | steps "
            "| minutes | ledger | balanced | exit |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for row in rows:
        ledger = ", ".join(f"{k} {v}" for k, v in sorted(row["ledger"].items()))
        lines.append(
            f"| {row['example']} | {fmt(row['val_start'])} | {fmt(row['val_end'])} ({fmt(row['val_end_version'])}) "
            f"| {fmt(row['train_reward_first'])} | {fmt(row['steps'])} | {fmt(row['minutes'])} | {ledger} "
            f"| {fmt(row['balanced'])} | {row['exit']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6.0, help="each example's run length (default 6)")
    parser.add_argument("--only", default="", help="comma-separated example names (default: all five)")
    parser.add_argument("--val-samples", type=int, default=32, help="held-out problems per measurement")
    parser.add_argument("--out", default="runs/real_model_tour.json", help="where the rows are written")
    args = parser.parse_args(argv)
    if not Path(REAL_MODEL, "config.json").is_file():
        print(f"real_model_tour: {REAL_MODEL} is missing: run `make real-model` first", file=sys.stderr)
        return 2
    chosen = [e for e in EXAMPLES if not args.only or e.name in args.only.split(",")]
    rows = []
    for example in chosen:
        row = run_example(example, args.minutes, args.val_samples)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(table(rows))
    return 0 if all(row["exit"] == 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
