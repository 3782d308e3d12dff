"""`squall show trajectories|trajectory KEY|group ID`: the trajectory viewer in the terminal.

    squall show trajectories --run R [--version V] [--status ok] [--ledger filtered] [--min-reward X]
    squall show trajectory 'g3:1#0' --run R [--json]
    squall show group g3 --run R

Reads what monitor.trajectories reads: the kept sample in the run folder (`--run-dir`, else the
run's config) and, when the run's Redis answers, the live stream and the ledger. Token ids are
decoded with the tokenizer of `--model-dir` (else the run's model.path); without one, ids are
printed. An id that does not exist is an error (exit 2) saying where it looked.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from squall.shared.cliargs import add_common_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["trajectories", "trajectory", "group"])
    parser.add_argument("id", nargs="?", help="the attempt (`<group>:<index>#<attempt>`) or group id")
    add_common_arguments(parser)
    parser.add_argument("--run-dir", help="the run folder holding rollouts/ (default: the run's run.dir)")
    parser.add_argument("--model-dir", help="the tokenizer's folder (default: the run's model.path)")
    parser.add_argument("--version", type=int, help="only attempts sampled by this weight version")
    parser.add_argument("--group", help="only this group's attempts")
    parser.add_argument("--status", choices=["ok", "failed", "timeout", "cancelled"])
    parser.add_argument("--ledger", help="only attempts in this ledger state (prefix: `filtered`)")
    parser.add_argument("--mode", choices=["train", "val"])
    parser.add_argument("--min-reward", type=float)
    parser.add_argument("--max-reward", type=float)
    parser.add_argument("-n", type=int, default=50, help="rows listed at most (default 50)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _connect(config: Any) -> Any:
    """The run's Redis when it answers and holds the run; else None (the run folder alone)."""
    import redis

    from squall.shared.keys import Keys
    from squall.shared.redisconn import connect

    try:
        r = connect(config.run.redis_url)
        keys = Keys(config.run.name)
        if r.exists(keys.ledger, keys.trajectories, keys.config, keys.heartbeats):
            return r
    except redis.RedisError:
        pass
    print(
        f"squall show: run {config.run.name!r} is not in Redis at {config.run.redis_url.split('@')[-1]}: "
        "reading the run folder only",
        file=sys.stderr,
    )
    return None


def render_list(listing: dict[str, Any]) -> str:
    lines = [
        f"{listing['matched']} of {listing['total']} attempts "
        f"(kept {listing['sources']['kept']}, live {listing['sources']['live']})",
        f"{'attempt':<22} {'ver':>4} {'mode':<5} {'status':<9} {'reward':>7} {'turns':>5}  ledger",
    ]
    for row in listing["rows"]:
        reward = "-" if row["reward"] is None else f"{row['reward']:.3f}"
        lines.append(
            f"{row['key']:<22} {row['version']:>4} {row['mode']:<5} {row['status']:<9} {reward:>7} "
            f"{row['turns']:>5}  {row['ledger'] or '-'}"
        )
    return "\n".join(lines)


def render_detail(d: dict[str, Any]) -> str:
    group = d["group"]
    advantage = "-" if group["advantage"] is None else f"{group['advantage']:+.3f}"
    lines = [
        f"attempt {d['key']}  group {d['group_id']} (member {d['index']} of {d['group_size']})  mode {d['mode']}",
        f"status {d['status']}  reward {d['reward']}  advantage {advantage} ({group['estimator']} over "
        f"{group['members_found']} members found)  ledger {d['ledger'] or '-'}",
        f"version {d['version']} (min {d['min_version']})  runner {d['runner']}  source {d['source']}",
        f"timings {json.dumps(d['timings'])}",
    ]
    if d["error"]:
        lines.append(f"error {d['error']}")
    if d["payload"] is not None:
        lines.append(f"task {json.dumps(d['payload'])[:400]}")
    for turn in d["turns"]:
        lines.append("")
        lines.append(
            f"--- turn {turn['index']}: agent {turn['agent']}  model {turn['model']}  "
            f"{'trained' if turn['trained'] else 'not trained'}  v{turn['version']}  node {turn['node'] or '-'}  "
            f"{turn['latency_s']:.2f}s  {turn['finish_reason']}  prompt {turn['prompt_tokens']} tok, "
            f"response {turn['response_tokens']} tok ({turn['loss_tokens']} with loss)"
        )
        if d["decoded"]:
            shown = turn["new_prompt_text"] if turn["prompt_continues"] else turn["prompt_text"]
            lines.append(
                ("[prompt, new since the last call]\n" if turn["prompt_continues"] else "[prompt]\n") + shown
            )
            lines.append("[response]\n" + turn["response_text"])
        else:
            lines.append(f"[prompt ids] {turn['prompt_ids']}")
            lines.append(f"[response ids] {turn['response_ids']}")
        for call in turn["tool_calls"]:
            lines.append(f"[tool call] {json.dumps(call)}")
    if d["final_answer"] is not None:
        lines.append(f"\nfinal answer: {d['final_answer']}")
    return "\n".join(lines)


def render_group(g: dict[str, Any]) -> str:
    lines = [f"group {g['group_id']} ({g['estimator']} advantages)"]
    for m in g["members"]:
        adv = "-" if m["advantage"] is None else f"{m['advantage']:+.3f}"
        reward = "-" if m["reward"] is None else f"{m['reward']:.3f}"
        last = (m["last_response"] or m["final_answer"] or "").replace("\n", " ")[:80]
        lines.append(
            f"  {m['key']:<20} {m['status']:<9} reward {reward:>7} adv {adv:>7}  {m['ledger'] or '-':<18} {last}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.keys import Keys

    from .trajectories import Filters, NotFound, TrajectoryView, jsonable, resolve_dirs

    config = config_from_args(args)
    if args.what != "trajectories" and not args.id:
        print(
            f"squall show {args.what}: give the {'attempt' if args.what == 'trajectory' else 'group'} id",
            file=sys.stderr,
        )
        return 2
    keys = Keys(config.run.name)
    r = _connect(config)
    run_dir, model_dir = resolve_dirs(r, keys, config, args.run_dir, args.model_dir)
    view = TrajectoryView(r, keys, run_dir, model_dir, config.trainer.advantage)
    try:
        if args.what == "trajectories":
            filters = Filters(
                version=args.version,
                group=args.group,
                status=args.status,
                ledger=args.ledger,
                mode=args.mode,
                min_reward=args.min_reward,
                max_reward=args.max_reward,
            )
            body, text = view.list(filters, args.n), render_list
        elif args.what == "trajectory":
            body, text = view.detail(args.id), render_detail
        else:
            body, text = view.group(args.id), render_group
    except NotFound as exc:
        print(f"squall show: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(jsonable(body), indent=2) if args.json else text(body))
    return 0
