"""squall from Python: `squall.up(config)` runs what `squall up --config` runs, and returns.

Parts:
- `config(source, **sections)`: a RunConfig from a run file, a dict or another RunConfig, with
  whole sections or single fields replaced, validated (errors name the field);
- `up(config, **options)`: a whole run on this machine (services/local/up.py), the options being
  `squall up`'s flags; returns an `UpResult` instead of exiting;
- `init(folder)`: `squall init` (services/local/init.py).

A config that is not a file is resolved here (environment variables over it, as over a run
file) and handed to `Up` as it is; `Up` writes it into the run folder (mode 0600, removed at the
end) for the run's services, which are separate processes, to read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from squall.local.up import UpOptions
    from squall.shared.config import RunConfig


def config(source: Any = None, /, **sections: Any) -> RunConfig:
    """A validated RunConfig: `source` (a run file's path, a dict of sections, a RunConfig or
    None for the defaults), then `sections` on top, each a dict of fields (merged into that
    section) or a section model (replacing it). Environment variables are not applied here;
    `up` applies them as the command line does.

        cfg = squall.config("examples/calc/demo.toml", scheduler={"max_samples": 64})
        cfg.trainer.lr = 1e-4          # assignments are validated too
    """
    from squall.shared.config import Section, load_config, merge

    base = _as_dict(source)
    extra = {}
    for name, value in sections.items():
        extra[name] = value.model_dump(mode="json") if isinstance(value, Section) else value
    if isinstance(source, (str, os.PathLike)):
        return load_config(source, env={}, overrides=extra)
    return load_config(None, env={}, overrides=merge(base, extra))


def _as_dict(source: Any) -> dict[str, Any]:
    from squall.shared.config import RunConfig
    from squall.shared.errors import ConfigError

    if source is None or isinstance(source, (str, os.PathLike)):
        return {}
    if isinstance(source, RunConfig):
        return source.model_dump(mode="json")
    if isinstance(source, Mapping):
        return {name: dict(value) if isinstance(value, Mapping) else value for name, value in source.items()}
    raise ConfigError(
        f"a run config must be a file path, a dict of sections or a RunConfig, not {type(source).__name__}"
    )


@dataclass
class UpResult:
    """How a run ended and what it measured (the run folder's summary.json, as a dict)."""

    exit_code: int  # what `squall up` would exit with: 0 finished or stopped on time, 1 failed, 130 SIGINT
    reason: str  # why it stopped: "scheduler finished the dataset", "time limit of 5 minutes", ...
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)  # empty when the run failed before a report

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def val_curve(self) -> list[dict[str, Any]]:
        """Validation rounds: {version, mean, count, time} each."""
        return list(self.summary.get("val_curve", []))

    @property
    def train_curve(self) -> list[dict[str, Any]]:
        """One point per trained group: {version, mean, count, time}."""
        return list(self.summary.get("train_curve", []))

    @property
    def ledger(self) -> dict[str, int]:
        """Attempts per state, plus `dispatched`."""
        return dict(self.summary.get("ledger", {}))

    @property
    def ledger_balanced(self) -> bool:
        return bool(self.summary.get("ledger_balanced", False))

    @property
    def curve_png(self) -> Path | None:
        path = self.run_dir / "learning_curve.png"
        return path if path.exists() else None

    def __str__(self) -> str:
        start, end = self.summary.get("val_reward_start"), self.summary.get("val_reward_end")
        shown = "n/a" if start is None or end is None else f"{start:.3f} -> {end:.3f}"
        if end is not None:
            from squall.local.up import measured_word

            shown += f" {measured_word(self.summary)}"
        return (
            f"run {self.summary.get('run', '?')} in {self.run_dir}: exit {self.exit_code} ({self.reason}); "
            f"validation reward {shown}; steps {self.summary.get('steps', 0)}; "
            f"ledger balanced={self.ledger_balanced}"
        )


def up_options(**options: Any) -> UpOptions:
    """`squall up`'s flags as UpOptions (named as the flags are, with underscores: runners=4,
    inference_nodes=2, minutes=5, keep=True, label=...); an unknown one is a ConfigError."""
    from squall.local.up import UpOptions
    from squall.shared.errors import ConfigError

    known = [f.name for f in dataclasses.fields(UpOptions) if f.name != "config"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"squall.up() has no option {unknown[0]!r}; known: {', '.join(sorted(known))} "
            "(set the run name and Redis URL in the config's [run] section)"
        )
    chosen = UpOptions(**options)
    if problem := chosen.problem():
        raise ConfigError(f"squall.up(): {problem.replace('--trainer-ranks', 'trainer_ranks')}")
    return chosen


def up(source: Any, /, **options: Any) -> UpResult:
    """Run `squall up` on `source` (a run file's path, a dict of sections or a RunConfig) in this
    process: start Redis (when none answers), inference, trainer, scheduler and runners, print
    progress, stop them all in order, and return the result. Never calls sys.exit; Ctrl-C stops
    the run cleanly and the result says so (exit_code 130). SQUALL_<SECTION>__<FIELD> environment
    variables override the config, as they override a run file given to the command line."""
    from squall.local.up import Up
    from squall.shared.config import load_config
    from squall.shared.redisconn import owned_servers

    chosen = up_options(**options)
    if isinstance(source, (str, os.PathLike)):
        chosen.config = os.fspath(source)
        resolved = load_config(chosen.config)
    else:  # the services get the resolved config from a file Up writes into the run folder
        resolved = load_config(None, base=config(source).model_dump(mode="json"))
    with owned_servers():  # the command's embedded Redis dies with its process; ours with this call
        runner = Up(resolved, chosen)
        code = runner.run()
    return UpResult(code, runner.reason or "done", Path(resolved.run.dir), dict(runner.summary or {}))


def init(folder: str | os.PathLike[str], **options: Any) -> Path:
    """`squall init FOLDER`: write run.toml, agent.py and a tiny dataset; returns the run file."""
    from squall.local.init import scaffold

    return scaffold(Path(folder), **options)
