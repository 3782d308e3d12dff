"""squall: reinforcement-learning training for any LLM agent, as services on Redis Streams.

Import names: the folder `services/` is the package `squall` (services/runner is
`squall.runner`, ...) and the folder `shared/` is `squall.shared`; see README "Layout".

From Python (services/api.py; nothing is imported until first used, so `import squall` and
`squall --help` stay fast):

    import squall
    cfg = squall.config("examples/calc/demo.toml", scheduler={"max_samples": 64})
    result = squall.up(cfg, minutes=5)     # what `squall up` does; returns, never exits
    print(result, result.val_curve)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute), imported on first access
_LAZY: dict[str, tuple[str, str]] = {
    "up": ("squall.api", "up"),
    "config": ("squall.api", "config"),
    "init": ("squall.api", "init"),
    "UpResult": ("squall.api", "UpResult"),
    "RunConfig": ("squall.shared.config", "RunConfig"),
    "load_config": ("squall.shared.config", "load_config"),
    "ConfigError": ("squall.shared.errors", "ConfigError"),
    "demo_policy": ("squall.local.init", "demo_policy"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'squall' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
