"""TensorBoard: event files under `{tracking.dir}/tensorboard` (torch's SummaryWriter).

Each scalar is logged at its own axis' step (`trainer/*` at the trainer step, the rest at the
weight version); samples are a markdown table under the text tag `samples`, at the version.
A restarted tracker opens a new event file in the same folder; TensorBoard reads them as one run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from squall.shared.config import RunConfig

from .backends import Backend, missing_library
from .sources import SAMPLE_COLUMNS, SampleRow

SUBDIR = "tensorboard"


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def markdown_table(rows: list[SampleRow]) -> str:
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(_cell(c) for c in row.cells()) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardBackend(Backend):
    name = "tensorboard"

    def __init__(self, config: RunConfig, folder: Path, state: dict[str, Any]) -> None:
        try:
            import tensorboard  # noqa: F401  (SummaryWriter needs it; name it in the error)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing_library("tensorboard", "tensorboard") from None
        self.folder = folder / SUBDIR
        self.writer = SummaryWriter(log_dir=str(self.folder))

    def log_scalars(self, axis: str, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, version: int, rows: list[SampleRow]) -> None:
        self.writer.add_text("samples", markdown_table(rows), version)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
