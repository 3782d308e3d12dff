"""`squall status [--json]`: the run at a glance.

Ledger (attempts per state and the conservation check), stream lengths, per-group lag and
pending counts (XINFO GROUPS), live runners and other processes (heartbeats), the trainer's
and each inference node's weight version, open groups, and the recent rewards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from squall.shared.cliargs import add_common_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--rewards", type=int, default=10, help="recent reward points to show (default 10)")


def _streams(snap: Any) -> dict[str, Any]:
    streams: dict[str, Any] = {}
    for name, stream in snap.streams.items():
        info: dict[str, Any] = {"length": stream.length}
        if stream.groups:
            info["groups"] = {
                g.group: {"pending": g.pending, "lag": g.lag, "consumers": g.consumers} for g in stream.groups
            }
        streams[name] = info
    return streams


def _processes(snap: Any) -> dict[str, Any]:
    out = {}
    for p in snap.processes:
        beat_time = p.beat.time if p.beat is not None else None
        age = round(p.age_s, 1) if p.age_s is not None else None
        out[p.id] = {"time": beat_time, **p.fields(), "age_s": age, "alive": p.alive, "state": p.state}
    return out


def _rewards(snap: Any, count: int) -> list[dict[str, Any]]:
    points = (
        sorted([*snap.train_rewards, *snap.val_rewards], key=lambda p: p.time)[-count:] if count > 0 else []
    )
    return [{"version": p.version, "mode": p.mode, "mean": p.mean, "count": p.count, "group_id": p.group_id}
            for p in points]  # fmt: skip


def collect(r: Any, run: str, rewards: int = 10) -> dict[str, Any]:
    """Everything `squall status` shows, as plain data (shared.runstate's snapshot, rendered)."""
    from squall.shared.keys import Keys
    from squall.shared.runstate import read_snapshot
    from squall.worker.status import pool_summary

    snap = read_snapshot(r, Keys(run), rewards=max(rewards, 0), metrics=0)
    return {
        "run": run,
        "ledger": {
            "dispatched": snap.ledger.dispatched,
            "states": snap.ledger.counts,
            "balanced": snap.ledger.balanced,
        },
        "streams": _streams(snap),
        "processes": _processes(snap),
        "runners_alive": len(snap.alive("runner")),
        "versions": snap.versions.raw,
        "open_groups": snap.open_groups,
        "finished": snap.finished,
        "end": dataclasses.asdict(snap.end) if snap.end is not None else None,
        "scheduler": snap.scheduler,
        "rewards": _rewards(snap, rewards),
        "skipped": snap.skipped,
        "warnings": [w.fields() for w in snap.warnings],
        "tools": pool_summary(r, run),
        "infra": {k.decode(): int(v) for k, v in r.hgetall(Keys(run).infra).items()},
    }


def render(status: dict[str, Any]) -> str:
    lines = [f"run {status['run']}"]
    lines += [f"WARNING    {w['message']}" for w in status.get("warnings", [])]
    ledger = status["ledger"]
    check = "OK" if ledger["balanced"] else "MISMATCH"
    states = "  ".join(f"{k}={v}" for k, v in sorted(ledger["states"].items()))
    lines.append(f"ledger     dispatched={ledger['dispatched']}  {states}  conservation {check}")
    if status.get("infra"):  # attempts failed because no policy node answered (scheduler outcomes)
        lines.append("infra      " + "  ".join(f"{k}={v}" for k, v in sorted(status["infra"].items())))
    lines.append("streams")
    for name, info in status["streams"].items():
        groups = "  ".join(
            f"[{g}: lag={v['lag']} pending={v['pending']} consumers={v['consumers']}]"
            for g, v in info.get("groups", {}).items()
        )
        lines.append(f"  {name:<16} {info['length']:>8}  {groups}")
    lines.append(f"processes  ({status['runners_alive']} runners alive)")
    for name, body in sorted(status["processes"].items()):
        state = {"alive": "alive", "stopped": "stopped"}.get(body.get("state", ""), "GONE")
        extra = {k: v for k, v in body.items() if k not in ("time", "age_s", "alive", "state", "stopped")}
        age = "-" if body["age_s"] is None else body["age_s"]
        lines.append(f"  {name:<40} {state:<7} {age:>7}s ago  {json.dumps(extra)[:120]}")
    versions = "  ".join(f"{k}={v}" for k, v in sorted(status["versions"].items())) or "(none yet)"
    lines.append(f"versions   {versions}")
    sched = status["scheduler"]
    lines.append(
        f"scheduler  epoch={sched.get('epoch', '-')} samples={sched.get('samples', '-')} {_groups_word(status)} "
        f"paused={sched.get('paused', '0')} draining={sched.get('draining', '0')}"
        + (" finished" if status.get("finished") else "")
    )
    end = status.get("end") or {}
    if end.get("scheduler_at") is not None:
        answer = "training what it holds" if end.get("trainer_version") is None else (
            f"last version v{end['trainer_version']} (step {end['trainer_step']})"
        )  # fmt: skip
        lines.append(f"end        data ran out ({end['samples']} samples); trainer: {answer}")
    lines.append("rewards    " + ("(none yet)" if not status["rewards"] else ""))
    for p in status["rewards"]:
        lines.append(f"  v{p['version']:<5} {p['mode']:<5} mean={p['mean']:.4f}  n={p['count']}")
    tools = status.get("tools")
    if tools and (tools["workers"] or any(sum(q.values()) for q in tools["queues"].values())):
        from squall.worker.status import format_summary

        lines.append(format_summary(tools))
    return "\n".join(lines)


def _groups_word(status: dict[str, Any]) -> str:
    """Open groups; once the run finished, those left are held groups no trainer consumed."""
    if status.get("finished") and status["open_groups"]:
        return f"held_groups={status['open_groups']} (rolled out, never consumed by a trainer)"
    return f"open_groups={status['open_groups']}"


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.runlookup import find_run_for

    config = config_from_args(args)
    client = find_run_for(args, config, "status")
    if client is None:
        return 2
    status = collect(client, config.run.name, args.rewards)
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0 if status["ledger"]["balanced"] else 1
