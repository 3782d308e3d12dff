"""The `squall` command: one subcommand per service and a few tools.

Nothing heavy is imported here: a subcommand's module is imported only once it is chosen,
so `squall --help` answers fast.  A subcommand module provides
`add_arguments(parser)` and `main(args) -> int`.

A command whose optional libraries are missing stops with one line naming the extra to
install (`squall.shared.extras`), never a traceback: NEEDS lists what each command imports
before it can do anything, and a later ModuleNotFoundError for an optional library (one a
config choice pulls in, e.g. pyarrow for a parquet dataset) is reported the same way.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module, one-line help). Listed only when the module is installed.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "squall.local.up",
        "start a whole run on this machine (redis, inference, trainer, scheduler, runners)",
    ),
    "init": (
        "squall.local.init",
        "write a run folder (run.toml with every field documented, agent.py, a tiny dataset)",
    ),
    "scheduler": (
        "squall.scheduler.cli",
        "run the scheduler: dataset -> GRPO groups -> tasks, retries, ledger",
    ),
    "optimize": (
        "squall.optimizer.cli",
        "optimise a resource (a system prompt) of the run: APO by textual gradients and a beam",
    ),
    "runner": ("squall.runner.cli", "run a runner: execute task attempts with your agent"),
    "trainer": ("squall.trainer.cli", "run the trainer: trajectories -> GRPO steps -> weights"),
    "inference": ("squall.inference.cli", "serve a model over an OpenAI-compatible API with hot reload"),
    "status": ("squall.monitor.status", "show streams, lag, ledger, runners, versions, rewards"),
    "dashboard": ("squall.monitor.cli", "serve the live web dashboard"),
    "acl": ("squall.monitor.acl", "write a Redis ACL file with one least-privilege user per service"),
    "toolpool": (
        "squall.toolpool.cli",
        "run the tool pool: rq workers for code, retrieval, SQL and judge jobs",
    ),
    "worker": ("squall.toolpool.cli", "the same as `squall toolpool` (its older name, kept for scripts)"),
    "redis": ("squall.local.redis_cmd", "run a local Redis-compatible server"),
    "peek": ("squall.monitor.peek", "print stream entries decoded to JSON"),
    "track": (
        "squall.tracking.cli",
        "log a run's metrics, rewards, ledger and samples to W&B, TensorBoard, MLflow",
    ),
    "show": ("squall.monitor.show", "read kept attempts turn by turn, decoded with the run's tokenizer"),
    "rescore": (
        "squall.monitor.rescore",
        "apply a new reward function to kept attempts and compare (no model call)",
    ),
    "model": ("squall.local.model_import", "import a model: `squall model import FILE.gguf OUT/`"),
    "export": ("squall.local.export", "write a published weight version as a Hugging Face model folder"),
}


# name -> optional libraries the command cannot start without (the extra comes from shared/extras.py).
# `up` starts inference and the trainer as child processes, so it checks for them up front.
NEEDS: dict[str, tuple[str, ...]] = {
    "up": ("torch", "transformers", "safetensors"),
    "trainer": ("torch", "transformers", "safetensors"),
    "inference": ("torch", "transformers", "safetensors"),
    "export": ("torch", "safetensors"),
    "model": ("torch", "transformers", "gguf"),
}


def _available() -> dict[str, tuple[str, str]]:
    available = {}
    for name, (module, help_text) in COMMANDS.items():
        try:
            if importlib.util.find_spec(module) is not None:
                available[name] = (module, help_text)
        except ModuleNotFoundError:
            continue
    return available


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = _available()
    width = max(len(name) for name in commands)
    listing = "\n".join(f"  {name.ljust(width)}  {help_text}" for name, (_, help_text) in commands.items())
    top = argparse.ArgumentParser(
        prog="squall",
        description="Reinforcement-learning training for any LLM agent, on Redis Streams.",
        epilog=f"commands:\n{listing}\n\nRun `squall COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("command", choices=sorted(commands), metavar="COMMAND")
    top.add_argument("--version", action="version", version="squall 0.1.0")
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    args = top.parse_args(argv[:1])
    return _run_command(args.command, commands[args.command], argv[1:])


def _run_command(name: str, entry: tuple[str, str], argv: list[str]) -> int:
    from squall.shared.extras import MissingExtra, install_hint, optional_module, require

    module = importlib.import_module(entry[0])
    parser = argparse.ArgumentParser(prog=f"squall {name}", description=entry[1])
    module.add_arguments(parser)
    parsed = parser.parse_args(argv)  # --help answers even when an extra is missing
    try:
        require(name, NEEDS.get(name, ()))
        return int(module.main(parsed) or 0)
    except MissingExtra as missing:
        print(missing, file=sys.stderr)
    except ModuleNotFoundError as error:
        library = optional_module(error)
        if library is None:
            raise
        print(install_hint(name, library), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
