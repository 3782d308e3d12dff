"""MLflow: one MLflow run per squall run in experiment `tracking.project`, resumed by run id.

Scalars go through `MlflowClient.log_batch` (metric keys are limited to letters, digits and
`_-. /`: anything else becomes `_`); samples are JSON-lines artifacts
`samples/v{version}-{entry}.jsonl`. The default store is a folder, `{tracking.dir}/mlruns`:
MLflow 3 keeps its file store in maintenance and refuses it unless MLFLOW_ALLOW_FILE_STORE is
set, which this backend sets for that store only (any other URI is used as given).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from squall.shared.config import RunConfig

from .backends import Backend, missing_library, public_config
from .sources import SAMPLE_COLUMNS, SampleRow

SUBDIR = "mlruns"
BATCH = 1000  # MLflow's limit of metrics per log_batch
PARAMS_BATCH = 100  # and of params
PARAM_CHARS = 500
_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_key(name: str) -> str:
    return _BAD_KEY.sub("_", name)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = (
                json.dumps(value)[:PARAM_CHARS] if not isinstance(value, str) else value[:PARAM_CHARS]
            )
    return out


def store_uri(config: RunConfig, folder: Path) -> str:
    uri = config.tracking.mlflow_uri or str((folder / SUBDIR).resolve())
    if urlparse(uri).scheme in ("", "file"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if "://" not in uri:
            uri = Path(uri).resolve().as_uri()
    return uri


class MlflowBackend(Backend):
    name = "mlflow"

    def __init__(self, config: RunConfig, folder: Path, state: dict[str, Any]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise missing_library("mlflow", "mlflow-skinny") from None
        self.client = MlflowClient(tracking_uri=store_uri(config, folder))
        project = config.tracking.project
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        if not state.get("run_id"):
            run = self.client.create_run(
                experiment_id, run_name=config.run.name, tags={"squall.run": config.run.name}
            )
            state["run_id"] = run.info.run_id
            self._log_params(_flatten(public_config(config)), state["run_id"])
        self.run_id: str = state["run_id"]

    def _log_params(self, params: dict[str, str], run_id: str) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), PARAMS_BATCH):
            self.client.log_batch(run_id, params=items[i : i + PARAMS_BATCH])

    def log_scalars(self, axis: str, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + BATCH])

    def log_samples(self, version: int, rows: list[SampleRow]) -> None:
        lines = [json.dumps(dict(zip(SAMPLE_COLUMNS, row.cells(), strict=True))) for row in rows]
        name = f"samples/v{version:06d}-{rows[0].attempt.replace('#', '_').replace(':', '_')}.jsonl"
        self.client.log_text(self.run_id, "\n".join(lines) + "\n", name)

    def flush(self) -> None:
        pass  # every MlflowClient call is written (or sent) before it returns

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
