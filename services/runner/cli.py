"""`squall runner --agent module:function | --agent-cmd CMD [--concurrency K]`."""

from __future__ import annotations

import argparse

from squall.shared.cliargs import add_common_arguments, add_field_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    agent = parser.add_mutually_exclusive_group()
    add_field_flag(agent, "--agent", "runner.agent", metavar="MODULE:FUNCTION")
    add_field_flag(agent, "--agent-cmd", "runner.agent_cmd", metavar="CMD")
    add_field_flag(parser, "--concurrency", "runner.concurrency", metavar="K")
    add_field_flag(parser, "--reward-fn", "runner.reward_fn", metavar="MODULE:FUNCTION")
    add_field_flag(
        parser,
        "--inference-url",
        "runner.inference_urls",
        action="append",
        metavar="URL",
        help="policy inference node (repeat for several)",
    )


def main(args: argparse.Namespace) -> int:
    import asyncio

    from squall.shared.cliargs import config_from_args, field_flags
    from squall.shared.errors import RedisUnavailable
    from squall.shared.logs import configure_logging, get_logger
    from squall.shared.redisconn import connect

    from .agents import make_agent
    from .runner import Runner

    runner_fields = {}
    given = field_flags(args).get("runner", {})
    if given.get("agent") or given.get("agent_cmd"):  # a flag replaces the config's choice entirely
        runner_fields["agent" if given.get("agent_cmd") else "agent_cmd"] = ""
    config = config_from_args(args, runner=runner_fields)
    configure_logging("runner", config.run.name, level=config.run.log_level)
    agent = make_agent(config.runner.agent, config.runner.agent_cmd)
    r = connect(config.run.redis_url, autostart=False)
    try:
        import uvloop  # faster event loop for the gateway and the agents, when installed

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(Runner(config, r, agent).run())
    except RedisUnavailable as exc:  # Redis stayed away past run.redis_outage_s
        get_logger(component="runner").error("runner_exit", error=str(exc))
        return 1
