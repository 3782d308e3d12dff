"""Optional libraries and the pyproject extra that installs each one.

`squall X` checks the libraries its command needs before it starts (`squall.cli`), and turns a
`ModuleNotFoundError` for one of these libraries raised later into one line naming the extra,
instead of a traceback. tests/test_cli_extras.py checks this table against pyproject.toml.
"""

from __future__ import annotations

import importlib.util

# top-level import name -> the extra that installs it (pyproject.toml [project.optional-dependencies])
EXTRA_OF: dict[str, str] = {
    "torch": "ml",
    "transformers": "ml",
    "tokenizers": "ml",
    "safetensors": "ml",
    "peft": "ml",
    "gguf": "ml",
    "psutil": "ml",
    "pyarrow": "data",
    "matplotlib": "data",
    "bm25s": "tools",
    "wandb": "track",
    "tensorboard": "track",
    "mlflow": "track",
    "ray": "ray",
    "vllm": "gpu",
    "verl": "gpu",
    "flash_attn": "gpu",
}


class MissingExtra(Exception):
    """A command needs an optional library that is not installed."""

    def __init__(self, command: str, module: str) -> None:
        self.command = command
        self.module = module
        super().__init__(install_hint(command, module))


def install_hint(command: str, module: str) -> str:
    """One line: what is missing and the pip command that installs it."""
    extra = EXTRA_OF.get(module)
    if extra is None:
        return f"squall {command} needs {module}: pip install {module}"
    return f"squall {command} needs {module}: pip install 'squall[{extra}]'"


def is_installed(module: str) -> bool:
    """True when `module` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked or half-installed package counts as missing
        return False


def require(command: str, modules: tuple[str, ...]) -> None:
    """Raise MissingExtra for the first of `modules` that is not installed."""
    for module in modules:
        if not is_installed(module):
            raise MissingExtra(command, module)


def optional_module(error: ModuleNotFoundError) -> str | None:
    """The optional library behind `error` (its top-level name), or None when it is not one."""
    top = (error.name or "").split(".")[0]
    return top if top in EXTRA_OF else None
