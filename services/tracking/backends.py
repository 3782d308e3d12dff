"""The `Backend` interface every tracking destination implements, and the factory.

A backend receives scalars against one of two x-axes — `step` (the trainer's optimizer
step: `trainer/*` metrics) and `version` (the policy weight version: `reward/*`, `ledger/*`
and the samples table) — and tables of rollout samples. Its library is imported only when
the backend is made, so `squall track --help` and runs without tracking never import it.
`state` is the backend's own corner of the cursor: what it needs to resume the same tracked
run after a restart (a run id), saved by the tracker after every flushed poll.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from squall.shared.config import RunConfig
from squall.shared.errors import ConfigError

from .sources import SampleRow

KNOWN = ("wandb", "tensorboard", "mlflow")
AXIS_KEYS = {"step": "trainer/step", "version": "version"}  # x-axis name per axis, as logged


class Backend(ABC):
    name: str

    @abstractmethod
    def log_scalars(self, axis: str, step: int, values: dict[str, float]) -> None:
        """Log `values` at `step` of `axis` ("step" or "version")."""

    @abstractmethod
    def log_samples(self, version: int, rows: list[SampleRow]) -> None:
        """Log rollouts of policy `version` as a table."""

    @abstractmethod
    def flush(self) -> None:
        """Make everything logged so far durable (called before the cursor is saved)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and end the tracked run."""


def public_config(config: RunConfig) -> dict[str, Any]:
    """The run config as logged: the Redis URL's password and every API key left out."""
    from squall.shared.redisconn import redact

    data = config.model_dump(mode="json")
    data["run"]["redis_url"] = redact(config.run.redis_url)
    for section in data.values():
        if isinstance(section, dict) and section.get("api_key"):
            section["api_key"] = "<set>"
    return data


def make_backend(name: str, config: RunConfig, folder: Path, state: dict[str, Any]) -> Backend:
    """The backend called `name`, logging run `config.run.name` (files under `folder`)."""
    if name == "wandb":
        from .wandb_backend import WandbBackend

        return WandbBackend(config, folder, state)
    if name == "tensorboard":
        from .tensorboard_backend import TensorBoardBackend

        return TensorBoardBackend(config, folder, state)
    if name == "mlflow":
        from .mlflow_backend import MlflowBackend

        return MlflowBackend(config, folder, state)
    raise ConfigError(f"unknown tracking backend {name!r}: known are {', '.join(KNOWN)}")


def missing_library(backend: str, module: str) -> ConfigError:
    return ConfigError(
        f"tracking backend {backend!r} needs the {module!r} package: pip install 'squall[track]' "
        f"(or remove {backend!r} from tracking.backends)"
    )
