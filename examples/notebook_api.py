"""squall from Python, notebook style: build a run config in code, run it, look at the result.

Each `# %%` block is a cell (Jupyter, VS Code and PyCharm run them one by one); as a script,
from the repository root:

    python -m examples.notebook_api     # 1.2 minutes here: validation reward 0.44 -> 1.00 (16 problems)

It trains the calculator agent of the demo (examples/calc) on 64 problems with the committed
demo policy, then prints the validation curve and the ledger.
"""

# %% A dataset: 64 training and 16 validation problems from the demo's seeded generator.
from pathlib import Path

import squall
from examples.calc.tasks import generate, write_jsonl

data = Path("runs/notebook-data")
data.mkdir(parents=True, exist_ok=True)
write_jsonl(data / "train.jsonl", generate("train", 64, seed=0))
write_jsonl(data / "val.jsonl", generate("val", 16, seed=0))

# %% The run config, built in code. Every section and field is the run file's (shared/config.py);
# a wrong value fails here, naming the field (try trainer={"lr": -1}).
cfg = squall.config(
    run={"name": "notebook", "dir": "runs/notebook", "redis_url": "redis://127.0.0.1:6392/0"},
    model={"path": str(squall.demo_policy())},
    scheduler={
        "dataset": str(data / "train.jsonl"),
        "val_dataset": str(data / "val.jsonl"),
        "group_size": 8,
        "val_every": 4,
    },
    runner={"agent": "examples.calc.agent:agent", "concurrency": 16},
    trainer={"groups_per_step": 4, "lr": 3e-4},
)
cfg.trainer.clip_high = 0.28  # fields can be set one by one too, validated on assignment
# Or start from a run file and change a few fields:
#   cfg = squall.config("examples/calc/demo.toml", scheduler={"max_samples": 64})

# %% Run it: the same as `squall up` (embedded Redis, inference, trainer, scheduler, 2 runners),
# with progress lines while it runs. It returns when the data is used up (or after `minutes`);
# Ctrl-C / "interrupt kernel" stops it cleanly and returns too.
result = squall.up(cfg, runners=2, minutes=10, label="notebook")
print(result)

# %% What it measured: the validation curve, the ledger, the plot.
for point in result.val_curve:
    print(
        f"version {point['version']:3d}: validation reward {point['mean']:.3f} over {point['count']} problems"
    )
print("ledger:", result.ledger, "balanced:", result.ledger_balanced)
print("learning curve:", result.curve_png)
