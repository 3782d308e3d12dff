"""`squall init FOLDER`: a run folder that `squall up --config run.toml` runs as it is.

Parts:
- `render_run_file(values)`: run.toml with every section and every field of RunConfig, each
  commented with its docstring (the field's description), type and bounds, read from the
  pydantic models (so the file cannot drift from shared/config.py); values written by tomlkit;
  fields in `values` are set, the rest are shown commented out at their defaults;
- `demo_policy()` and `demo_source()`: the committed demo policy and the calculator example
  of a source checkout (examples/calc), which the scaffold points at and copies from;
- `scaffold(folder)`: run.toml, agent.py (the calculator agent: plain OpenAI SDK) and a tiny
  train/val dataset of calculator word problems.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

WRAP = 96  # comment width in run.toml
TRAIN_ROWS = 256  # the tiny dataset: ~3 minutes of training on 2 CPU cores
VAL_ROWS = 32
REDIS_URL = "redis://127.0.0.1:6390/0"  # a port of its own, as the demo's: never a Redis on 6379

# Shown above a section whose model has no docstring of its own.
SECTION_NOTES = {
    "run": "The run: its name (every Redis key lives under squall:{name}:), Redis, folder, seed.",
    "model": "The initial policy, and the name it is served under.",
    "scheduler": "`squall scheduler`: dataset -> GRPO groups -> tasks, admission, retries, validation.",
    "runner": "`squall runner`: your agent, its slots, and the local LLM gateway in front of inference.",
    "trainer": "`squall trainer`: groups -> advantages -> PPO-clip steps -> published weights.",
    "inference": "`squall inference`: the OpenAI-compatible server that hot-reloads new weights.",
}


# --- the demo assets of a source checkout ---------------------------------------------------
def demo_source() -> Path:
    """examples/calc of the checkout this squall runs from (the demo's agent, data generator
    and policy); a ConfigError saying what to do when squall was installed without it."""
    import squall
    from squall.shared.errors import ConfigError

    calc = Path(squall.__file__).resolve().parents[1] / "examples" / "calc"
    if not (calc / "policy" / "config.json").is_file() or not (calc / "agent.py").is_file():
        raise ConfigError(
            f"squall init copies the calculator agent, its data generator and the demo policy from "
            f"a source checkout of squall (examples/calc), and there is none at {calc}: install "
            "squall from a checkout (`git clone ...; pip install -e .`) and run it again"
        )
    return calc


def demo_policy() -> Path:
    """The committed 1.1M-parameter calculator policy (examples/calc/policy, built by sft.py)."""
    return demo_source() / "policy"


# --- run.toml from the models -------------------------------------------------------------
def field_docs(model: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the model's class body (pydantic keeps
    it as the field's description: `use_attribute_docstrings` on shared.config.Section)."""
    fields = model.model_fields  # type: ignore[attr-defined]
    return {name: " ".join(info.description.split()) for name, info in fields.items() if info.description}


def toml_value(value: Any) -> str:
    """`value` as a TOML literal (str, bool, int, float, list, table), written by tomlkit."""
    import tomlkit

    if isinstance(value, dict):
        table = tomlkit.inline_table()
        table.update(value)
        return table.as_string()
    return tomlkit.item(value).as_string()


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def field_kind(info: Any) -> str:
    """'one of: a, b' for a Literal, else the bounds ('>= 1, <= 1024'), else ''."""
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return "one of: " + ", ".join(str(choice) for choice in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        (inner,) = typing.get_args(annotation) or (Any,)
        if typing.get_origin(inner) is typing.Literal:
            return "each one of: " + ", ".join(str(choice) for choice in typing.get_args(inner))
    bounds = []
    for item in info.metadata:
        for name, sign in _BOUNDS.items():
            if getattr(item, name, None) is not None:
                bounds.append(f"{sign} {getattr(item, name)}")
        if getattr(item, "pattern", None):
            bounds.append(f"matches {item.pattern}")
    return ", ".join(bounds)


def _comment(text: str) -> list[str]:
    wrapped = textwrap.wrap(text, WRAP, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
    return wrapped or ["#"]


def render_section(name: str, model: type, values: dict[str, Any]) -> list[str]:
    unknown = set(values) - set(model.model_fields)  # type: ignore[attr-defined]
    if unknown:
        raise ValueError(f"[{name}] has no field(s) {sorted(unknown)}")
    note = " ".join((model.__doc__ or "").split()) or SECTION_NOTES.get(name, f"The [{name}] section.")
    lines = [*_comment(note), f"[{name}]"]
    docs = field_docs(model)
    for field, info in model.model_fields.items():  # type: ignore[attr-defined]
        kind = field_kind(info)
        text = docs.get(field, "(undocumented)") + (f" ({kind})" if kind else "")
        lines += _comment(text)
        if field in values:
            lines.append(f"{field} = {toml_value(values[field])}")
        else:
            default = info.get_default(call_default_factory=True)
            lines.append(f"# {field} = {toml_value(default)}")
    return lines


def render_run_file(values: dict[str, dict[str, Any]], header: str = "") -> str:
    """run.toml: every section and field of RunConfig; `values` are set, the rest commented out."""
    from squall.shared.config import RunConfig

    unknown = set(values) - set(RunConfig.model_fields)
    if unknown:
        raise ValueError(f"no section(s) {sorted(unknown)} in RunConfig")
    lines = [*(f"# {line}".rstrip() for line in header.splitlines())] if header else []
    run_docs = field_docs(RunConfig)
    for name, info in RunConfig.model_fields.items():
        if typing.get_origin(info.annotation) is dict:  # a table of named entries, e.g. [roles.NAME]
            entry = typing.get_args(info.annotation)[1]
            lines += ["", *render_map_section(name, entry, run_docs.get(name, ""), values.get(name, {}))]
            continue
        lines += ["", *render_section(name, info.annotation, values.get(name, {}))]  # type: ignore[arg-type]
    return "\n".join(lines).lstrip("\n") + "\n"


def render_map_section(name: str, entry: type, note: str, values: dict[str, Any]) -> list[str]:
    """A section of named entries (`[roles.<name>]`): its note, the fields one entry takes (as
    indented comments, which no one un-comments by accident into a wrong table), then the
    entries `values` sets, each as its own table."""
    lines = [*_comment(" ".join(note.split()) or f"The [{name}] tables."), f"[{name}]"]
    lines.append(f"# One entry: [{name}.<name>] with")
    docs = field_docs(entry)
    for field, info in entry.model_fields.items():  # type: ignore[attr-defined]
        kind = field_kind(info)
        text = f"{field}: " + docs.get(field, "(undocumented)") + (f" ({kind})" if kind else "")
        lines += textwrap.wrap(
            text, WRAP, initial_indent="#   ", subsequent_indent="#     ", break_on_hyphens=False
        )
    for key, fields in values.items():
        lines += [f"[{name}.{key}]", *(f"{field} = {toml_value(value)}" for field, value in fields.items())]
    return lines


# --- the scaffold ---------------------------------------------------------------------------
HEADER = """\
squall run file, written by `squall init`. Start the run from this folder:

    squall up --config run.toml            (or, in Python: squall.up("run.toml"))

Every section and every field is listed with what it does. A line `# field = value` shows the
default and is off: remove the `#` to set it. Relative paths are relative to the folder you
start from. Any field can be overridden per service by an environment variable
SQUALL_<SECTION>__<FIELD>, e.g. SQUALL_TRAINER__LR=1e-4."""

AGENT_HEADER = """\
# The agent of this run (`runner.agent = "agent:agent"` in run.toml): the calculator agent of
# squall's demo (examples/calc/agent.py), an ordinary OpenAI-SDK program that knows nothing
# about squall. Make it yours: keep the signature `async def agent(task, llm) -> float`
# (`task` is one dataset row, `llm` has base_url, model and api_key) and return the reward.
# The demo policy was trained on this system prompt and tool; a policy of your own need not be.
"""


def run_name_for(folder: Path) -> str:
    from squall.shared.keys import RUN_NAME_PATTERN

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", folder.resolve().name).strip("-.")[:64] or "run"
    return name if RUN_NAME_PATTERN.match(name) else f"run-{name}"[:64]


def run_values(name: str, model_path: str) -> dict[str, dict[str, Any]]:
    """The fields `squall init` sets: the demo's settings, sized for the tiny dataset."""
    return {
        "run": {"name": name, "redis_url": REDIS_URL, "dir": "out", "seed": 0},
        "model": {"path": model_path, "name": "policy"},
        "scheduler": {
            "dataset": "data/train.jsonl",
            "val_dataset": "data/val.jsonl",
            "group_size": 8,
            "max_inflight_groups": 8,
            "val_every": 8,
            "val_samples": VAL_ROWS,
            "task_timeout_s": 60.0,
        },
        "runner": {"agent": "agent:agent", "concurrency": 16},
        "trainer": {"backend": "torch", "groups_per_step": 4, "lr": 3e-4},
        "inference": {"backend": "torch", "max_batch": 64},
    }


# A model is "real" (a pretrained chat model, not the demo's tiny policy) past this many parameters.
REAL_MODEL_PARAMS = 20_000_000


def model_settings(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Settings read from the model folder that replace the tiny-policy defaults of `run_values`
    when the model is a real one: a small learning rate for full-weight RL on pretrained weights,
    the context from the model (capped at 4096 tokens, what a CPU run can afford), gradient
    checkpointing and a 2048-token micro-batch, a model checkpoint every 4 steps or 5 minutes
    (not every step: 1.6 GB for 135M parameters), and an attempt deadline that starts when a
    runner starts the attempt (scheduler.attempt_timeout_s), so queueing behind other attempts
    on one slow node does not count; task_timeout_s then only bounds that queueing."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text())
    params = _parameter_count(model_dir)
    if params < REAL_MODEL_PARAMS:
        return {}
    context = min(int(config.get("max_position_embeddings") or 2048), 4096)
    lr = 2e-6 if params < 1_000_000_000 else 1e-6
    return {
        "scheduler": {"task_timeout_s": 1800.0, "attempt_timeout_s": 300.0, "max_inflight_groups": 4},
        "trainer": {
            "lr": lr,
            "checkpoint_every": 4,
            "checkpoint_every_s": 300.0,
            "gradient_checkpointing": True,
            "max_tokens_per_microbatch": 2048,
            "max_seq_len": context,
            "groups_per_step": 2,
        },
        "inference": {"max_model_len": context, "max_batch": 32},
    }


def _parameter_count(model_dir: Path) -> int:
    """Parameters in the folder's safetensors files (from their headers: nothing is loaded)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(info["shape"])
    return total


def _calc_tasks(calc: Path) -> Any:
    """examples/calc/tasks.py of the checkout, loaded from its file (examples is not installed)."""
    spec = importlib.util.spec_from_file_location("squall_init_calc_tasks", calc / "tasks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scaffold(
    folder: Path,
    *,
    name: str = "",
    model: str = "",
    train: int = TRAIN_ROWS,
    val: int = VAL_ROWS,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write run.toml, agent.py and data/{train,val}.jsonl into `folder`; returns run.toml."""
    from squall.shared.config import load_config
    from squall.shared.errors import ConfigError

    if train < 1 or val < 1:
        raise ConfigError(f"squall init: --train and --val must be at least 1 (got {train}, {val})")
    calc = demo_source()
    targets = [folder / "run.toml", folder / "agent.py", folder / "data" / "train.jsonl"]
    existing = [str(path) for path in targets if path.exists()]
    if existing and not force:
        raise ConfigError(f"squall init: {', '.join(existing)} already exist(s); pass --force to overwrite")
    values = run_values(
        name or run_name_for(folder), str(Path(model).resolve()) if model else str(demo_policy())
    )
    values["scheduler"]["val_samples"] = val
    for section, fields in (model_settings(Path(model)) if model else {}).items():
        values[section].update(fields)
    text = render_run_file(values, HEADER)
    load_config(None, env={}, overrides=values)  # what we set must validate before anything is written
    (folder / "data").mkdir(parents=True, exist_ok=True)
    tasks = _calc_tasks(calc)
    tasks.write_jsonl(folder / "data" / "train.jsonl", tasks.generate("train", train, seed))
    tasks.write_jsonl(folder / "data" / "val.jsonl", tasks.generate("val", val, seed))
    agent = (calc / "agent.py").read_text().replace("python -m examples.calc.agent", "python agent.py")
    (folder / "agent.py").write_text(AGENT_HEADER + agent)
    (folder / "run.toml").write_text(text)
    return folder / "run.toml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="the run folder to write (created if missing)")
    parser.add_argument("--name", default="", help="run name (default: the folder's name)")
    parser.add_argument("--model", default="", help="initial policy folder (default: the demo policy)")
    parser.add_argument(
        "--train", type=int, default=TRAIN_ROWS, help=f"training problems (default {TRAIN_ROWS})"
    )
    parser.add_argument("--val", type=int, default=VAL_ROWS, help=f"validation problems (default {VAL_ROWS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problem generator (default 0)")
    parser.add_argument("--force", action="store_true", help="overwrite run.toml, agent.py and the data")


def main(args: argparse.Namespace) -> int:
    from squall.shared.errors import ConfigError

    folder = Path(args.folder)
    try:
        run_file = scaffold(
            folder,
            name=args.name,
            model=args.model,
            train=args.train,
            val=args.val,
            seed=args.seed,
            force=args.force,
        )
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(
        f"squall init: wrote {run_file}, {folder / 'agent.py'} and {args.train}+{args.val} problems in "
        f"{folder / 'data'}\nnext:  cd {folder} && squall up --config run.toml"
    )
    return 0
