"""`squall status [--json]`: the run at a glance.

Ledger (attempts per state and the conservation check), stream lengths, per-group lag and
pending counts (XINFO GROUPS), live runners and other processes (heartbeats), the trainer's
and each inference node's weight version, open groups, the recent rewards, and the stalls found
now (services/monitor/stalls.py), each on a `STALL` line under the run's name.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from squall.shared.cliargs import add_common_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--rewards", type=int, default=10, help="recent reward points to show (default 10)")


def _recent_rewards(snap: Any, count: int) -> list[dict[str, Any]]:
    """The newest `count` reward points, train and validation together, oldest first."""
    from squall.monitor.snapshot_json import reward_points

    points = sorted([*snap.train_rewards, *snap.val_rewards], key=lambda p: p.time)
    return reward_points(points[-count:]) if count > 0 else []


def collect(r: Any, run: str, rewards: int = 10, config: Any = None) -> dict[str, Any]:
    """Everything `squall status` shows, as plain data: the run snapshot in its one JSON shape
    (monitor/snapshot_json.py), plus the tool pool, live runners, the newest rewards and the
    stalls found now (monitor/stalls.py)."""
    from squall.monitor.snapshot_json import render as render_snapshot
    from squall.monitor.stalls import detect, thresholds_for
    from squall.shared.config import RunConfig
    from squall.shared.keys import Keys
    from squall.shared.runstate import read_snapshot
    from squall.toolpool.summary import pool_summary

    snap = read_snapshot(r, Keys(run), rewards=max(rewards, 0), metrics=0)
    return {
        **render_snapshot(snap),
        "runners_alive": len(snap.alive("runner")),
        "recent_rewards": _recent_rewards(snap, rewards),
        "stalls": [
            s.fields() for s in detect(r, Keys(run), thresholds_for(r, Keys(run), config or RunConfig()))
        ],
        "tools": pool_summary(r, run),
        "infra": {k.decode(): int(v) for k, v in r.hgetall(Keys(run).infra).items()},
        "role_steps": _role_steps(r, Keys(run)),
    }


ROLE_STEP_SCAN = 500  # newest metrics entries searched for each role's last step


def _role_steps(r: Any, keys: Any) -> dict[str, dict[str, float]]:
    """[roles] runs: each role's newest step metrics ({} for the single policy): its step,
    version, filtered counts and staleness histogram among them."""
    from squall.shared import schemas
    from squall.shared.roles import DEFAULT_ROLE

    out: dict[str, dict[str, float]] = {}
    for _, fields in r.xrevrange(keys.metrics, count=ROLE_STEP_SCAN):
        try:
            message = schemas.decode(fields[schemas.ENTRY_FIELD], schemas.Metrics)
        except Exception:
            continue  # counted as skipped by the snapshot reader
        if message.role != DEFAULT_ROLE and message.role not in out:
            out[message.role] = {
                "step": float(message.step),
                "version": float(message.version),
                **message.values,
            }
    return out


def render(status: dict[str, Any]) -> str:
    lines = [f"run {status['run']}"]
    lines += [f"WARNING    {w['message']}" for w in status.get("warnings", [])]
    lines += [f"STALL      {s['kind']}: {s['message']}" for s in status.get("stalls", [])]
    ledger = status["ledger"]
    check = "OK" if ledger["balanced"] else "MISMATCH"
    states = "  ".join(f"{k}={v}" for k, v in sorted(ledger["counts"].items()))
    lines.append(f"ledger     dispatched={ledger['dispatched']}  {states}  conservation {check}")
    if status.get("infra"):  # attempts failed because no policy node answered (scheduler outcomes)
        lines.append("infra      " + "  ".join(f"{k}={v}" for k, v in sorted(status["infra"].items())))
    lines.append("streams")
    for name, length in status["streams"].items():
        groups = "  ".join(
            f"[{g['group']}: lag={g['lag']} pending={g['pending']} consumers={g['consumers']}]"
            for g in status["groups"]
            if g["stream"] == name
        )
        lines.append(f"  {name:<16} {length:>8}  {groups}")
    lines.append(f"processes  ({status['runners_alive']} runners alive)")
    for proc in status["heartbeats"]:
        state = {"alive": "alive", "stopped": "stopped"}.get(proc["state"], "GONE")
        extra = {k: v for k, v in proc["fields"].items() if k != "stopped"}
        age = "-" if proc["age_s"] is None else proc["age_s"]
        lines.append(f"  {proc['id']:<40} {state:<7} {age:>7}s ago  {json.dumps(extra)[:120]}")
    versions = "  ".join(f"{k}={v}" for k, v in sorted(status["versions"]["raw"].items())) or "(none yet)"
    lines.append(f"versions   {versions}")
    sched = status["scheduler"]
    lines.append(
        f"scheduler  epoch={sched.get('epoch', '-')} samples={sched.get('samples', '-')} {_groups_word(status)} "
        f"paused={sched.get('paused', '0')} draining={sched.get('draining', '0')}"
        + (" finished" if status.get("finished") else "")
    )
    end = status.get("end") or {}
    if end.get("scheduler_at") is not None:
        answer = (
            "training what it holds"
            if end.get("trainer_version") is None
            else (f"last version v{end['trainer_version']} (step {end['trainer_step']})")
        )
        lines.append(f"end        data ran out ({end['samples']} samples); trainer: {answer}")
    lines += _role_lines(status)
    lines.append("rewards    " + ("(none yet)" if not status["recent_rewards"] else ""))
    for p in status["recent_rewards"]:
        lines.append(f"  v{p['version']:<5} {p['mode']:<5} mean={p['mean']:.4f}  n={p['count']}")
    tools = status.get("tools")
    if tools and (tools["workers"] or any(sum(q.values()) for q in tools["queues"].values())):
        from squall.toolpool.summary import format_summary

        lines.append(format_summary(tools))
    return "\n".join(lines)


def _role_lines(status: dict[str, Any]) -> list[str]:
    """[roles] runs: one line per trained role (version, nodes serving it and how far behind,
    last train and validation rewards, its trainer group's backlog, last step's filtered counts
    and staleness)."""
    lines = []
    for name, role in status.get("roles", {}).items():
        train, val = role["rewards"]["train"], role["rewards"]["val"]
        nodes = " ".join(f"{n}={v}" for n, v in sorted(role["nodes"].items())) or "-"
        group = next((g for g in status["groups"] if g["group"] == f"trainer:{name}"), None)
        backlog = f"lag={group['lag']} pending={group['pending']}" if group else "no trainer group yet"
        step = status.get("role_steps", {}).get(name, {})
        counts = " ".join(
            f"{k}={int(v)}"
            for k, v in sorted(step.items())
            if k.startswith(("filtered:", "staleness/", "late"))
        )
        parts = [f"role {name:<12} version={role['version']}", f"nodes[{nodes}]"]
        parts += [f"train={train[-1]['mean']:.3f}"] if train else []
        parts += [f"val={val[-1]['mean']:.3f}"] if val else []
        parts += [backlog, f"step={int(step.get('step', 0))}"] + ([counts] if counts else [])
        lines.append(" ".join(parts))
    return lines


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
    status = collect(client, config.run.name, args.rewards, config)
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0 if status["ledger"]["balanced"] else 1
