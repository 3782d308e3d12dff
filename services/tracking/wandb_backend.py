"""Weights & Biases: one W&B run per squall run, resumed by id after a restart.

`trainer/*` are plotted against `trainer/step`, `reward/*`, `ledger/*` and `samples` against
`version` (W&B's define_metric), so neither axis has to be monotonic in W&B's own `_step`.
tracking.wandb_mode = offline writes files only (`wandb sync` uploads them later).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from squall.shared.config import RunConfig

from .backends import AXIS_KEYS, Backend, missing_library, public_config
from .sources import SAMPLE_COLUMNS, SampleRow


class WandbBackend(Backend):
    name = "wandb"

    def __init__(self, config: RunConfig, folder: Path, state: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise missing_library("wandb", "wandb") from None
        self.wandb = wandb
        state.setdefault("id", f"{config.run.name}-{secrets.token_hex(4)}")
        folder.mkdir(parents=True, exist_ok=True)
        track = config.tracking
        self.run = wandb.init(
            project=track.project,
            entity=track.wandb_entity or None,
            name=config.run.name,
            id=state["id"],
            resume="allow",
            dir=str(folder),
            mode=track.wandb_mode,
            config=public_config(config),
            settings=wandb.Settings(console="off", save_code=False),
        )
        self.run.define_metric(AXIS_KEYS["step"])
        self.run.define_metric("trainer/*", step_metric=AXIS_KEYS["step"])
        self.run.define_metric(AXIS_KEYS["version"])
        for pattern in ("reward/*", "ledger/*", "samples"):
            self.run.define_metric(pattern, step_metric=AXIS_KEYS["version"])

    def log_scalars(self, axis: str, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, AXIS_KEYS[axis]: step})

    def log_samples(self, version: int, rows: list[SampleRow]) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[row.cells() for row in rows])
        self.run.log({"samples": table, AXIS_KEYS["version"]: version})

    def flush(self) -> None:
        pass  # each log() is handed to W&B's own service process, which writes it in order

    def close(self) -> None:
        self.run.finish()
