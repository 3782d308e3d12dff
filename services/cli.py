"""The `squall` command: one subcommand per service and a few tools.

Nothing heavy is imported here: a subcommand's module is imported only once it is chosen,
so `squall --help` answers fast.  A subcommand module provides
`add_arguments(parser)` and `main(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module, one-line help). Listed only when the module is installed.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "squall.tools.up",
        "start a whole run on this machine (redis, inference, trainer, scheduler, runners)",
    ),
    "init": (
        "squall.tools.init",
        "write a run folder (run.toml with every field documented, agent.py, a tiny dataset)",
    ),
    "scheduler": (
        "squall.scheduler.cli",
        "run the scheduler: dataset -> GRPO groups -> tasks, retries, ledger",
    ),
    "runner": ("squall.runner.cli", "run a runner: execute task attempts with your agent"),
    "trainer": ("squall.trainer.cli", "run the trainer: trajectories -> GRPO steps -> weights"),
    "inference": ("squall.inference.cli", "serve a model over an OpenAI-compatible API with hot reload"),
    "status": ("squall.scheduler.status", "show streams, lag, ledger, runners, versions, rewards"),
    "dashboard": ("squall.monitor.cli", "serve the live web dashboard"),
    "acl": ("squall.monitor.acl", "write a Redis ACL file with one least-privilege user per service"),
    "worker": ("squall.worker.cli", "run the tool pool: rq workers for code, retrieval, SQL and judge jobs"),
    "redis": ("squall.tools.redis_cmd", "run a local Redis-compatible server"),
    "peek": ("squall.tools.peek", "print stream entries decoded to JSON"),
    "track": (
        "squall.tracking.cli",
        "log a run's metrics, rewards, ledger and samples to W&B, TensorBoard, MLflow",
    ),
    "model": ("squall.tools.model_import", "import a model: `squall model import FILE.gguf OUT/`"),
    "export": ("squall.tools.export", "write a published weight version as a Hugging Face model folder"),
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
    module = importlib.import_module(commands[args.command][0])
    parser = argparse.ArgumentParser(prog=f"squall {args.command}", description=commands[args.command][1])
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
