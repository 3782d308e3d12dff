"""`squall runner --agent module:function | --agent-cmd CMD [--concurrency K]`."""

from __future__ import annotations

import argparse

from squall.shared.cliargs import add_common_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    agent = parser.add_mutually_exclusive_group()
    agent.add_argument(
        "--agent", metavar="MODULE:FUNCTION", help="Python agent, async or sync (runner.agent)"
    )
    agent.add_argument("--agent-cmd", metavar="CMD", help="external agent command (runner.agent_cmd)")
    parser.add_argument("--concurrency", type=int, metavar="K", help="attempts at once (runner.concurrency)")
    parser.add_argument(
        "--reward-fn", metavar="MODULE:FUNCTION", help="reward(task, final_answer) (runner.reward_fn)"
    )
    parser.add_argument(
        "--inference-url", action="append", metavar="URL", help="policy inference node (repeat for several)"
    )


def main(args: argparse.Namespace) -> int:
    import asyncio

    from squall.shared.cliargs import config_from_args
    from squall.shared.errors import RedisUnavailable
    from squall.shared.logs import configure_logging, get_logger
    from squall.shared.redisconn import connect

    from .agents import make_agent
    from .runner import Runner

    runner_fields = {
        "agent": args.agent,
        "agent_cmd": args.agent_cmd,
        "concurrency": args.concurrency,
        "reward_fn": args.reward_fn,
        "inference_urls": args.inference_url,
    }
    if args.agent or args.agent_cmd:  # a flag replaces the config's choice entirely
        runner_fields["agent" if args.agent_cmd else "agent_cmd"] = ""
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
