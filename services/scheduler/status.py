"""`squall status [--json]`: the run at a glance.

Ledger (attempts per state and the conservation check), stream lengths, per-group lag and
pending counts (XINFO GROUPS), live runners and other processes (heartbeats), the trainer's
and each inference node's weight version, open groups, and the recent rewards.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from squall.shared.cliargs import add_common_arguments

STALE_AFTER_S = 15.0  # a heartbeat older than this marks its process as gone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--rewards", type=int, default=10, help="recent reward points to show (default 10)")


def collect(r: Any, run: str, rewards: int = 10) -> dict[str, Any]:
    """Everything `squall status` shows, as plain data."""
    from squall.shared.keys import Keys
    from squall.shared.ledger import Ledger

    keys = Keys(run)
    ledger = Ledger(r, keys).counts()
    dispatched = ledger.get("dispatched", 0)
    states = {k: v for k, v in ledger.items() if k != "dispatched"}
    streams: dict[str, Any] = {}
    for name, key in keys.stream_names().items():
        info: dict[str, Any] = {"length": int(r.xlen(key))}
        try:
            groups = r.xinfo_groups(key)
        except Exception:  # the stream does not exist yet
            groups = []
        if groups:
            info["groups"] = {
                _text(g["name"]): {
                    "pending": int(g["pending"]),
                    "lag": g.get("lag"),
                    "consumers": int(g["consumers"]),
                }
                for g in groups
            }
        streams[name] = info
    now = time.time()
    processes = {}
    for field, raw in r.hgetall(keys.heartbeats).items():
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        age = now - float(body.get("time", 0))
        processes[_text(field)] = {**body, "age_s": round(age, 1), "alive": age < STALE_AFTER_S}
    versions = {_text(k): int(v) for k, v in r.hgetall(keys.versions).items()}
    points = []
    for entry_id, fields in reversed(r.xrevrange(keys.rewards, count=rewards)):
        point = {_text(k): _text(v) for k, v in fields.items()}
        points.append({"id": _text(entry_id), "version": int(point.get("version", -1)), "mode": point.get("mode"),
                       "mean": float(point.get("mean", "nan")), "count": int(point.get("count", 0))})  # fmt: skip
    scheduler = {_text(k): _text(v) for k, v in r.hgetall(keys.scheduler_state).items()}
    return {
        "run": run,
        "ledger": {
            "dispatched": dispatched,
            "states": states,
            "balanced": sum(states.values()) == dispatched,
        },
        "streams": streams,
        "processes": processes,
        "runners_alive": sum(1 for k, p in processes.items() if k.startswith("runner:") and p["alive"]),
        "versions": versions,
        "open_groups": int(r.hlen(keys.groups)),
        "scheduler": scheduler,
        "rewards": points,
    }


def render(status: dict[str, Any]) -> str:
    lines = [f"run {status['run']}"]
    ledger = status["ledger"]
    check = "OK" if ledger["balanced"] else "MISMATCH"
    states = "  ".join(f"{k}={v}" for k, v in sorted(ledger["states"].items()))
    lines.append(f"ledger     dispatched={ledger['dispatched']}  {states}  conservation {check}")
    lines.append("streams")
    for name, info in status["streams"].items():
        groups = "  ".join(
            f"[{g}: lag={v['lag']} pending={v['pending']} consumers={v['consumers']}]"
            for g, v in info.get("groups", {}).items()
        )
        lines.append(f"  {name:<16} {info['length']:>8}  {groups}")
    lines.append(f"processes  ({status['runners_alive']} runners alive)")
    for name, body in sorted(status["processes"].items()):
        state = "alive" if body["alive"] else "GONE"
        extra = {k: v for k, v in body.items() if k not in ("time", "age_s", "alive")}
        lines.append(f"  {name:<40} {state:<5} {body['age_s']:>7}s ago  {json.dumps(extra)[:120]}")
    versions = "  ".join(f"{k}={v}" for k, v in sorted(status["versions"].items())) or "(none yet)"
    lines.append(f"versions   {versions}")
    sched = status["scheduler"]
    lines.append(
        f"scheduler  epoch={sched.get('epoch', '-')} samples={sched.get('samples', '-')} "
        f"open_groups={status['open_groups']} paused={sched.get('paused', '0')} draining={sched.get('draining', '0')}"
    )
    lines.append("rewards    " + ("(none yet)" if not status["rewards"] else ""))
    for p in status["rewards"]:
        lines.append(f"  v{p['version']:<5} {p['mode']:<5} mean={p['mean']:.4f}  n={p['count']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.redisconn import connect

    config = config_from_args(args)
    r = connect(config.run.redis_url)
    status = collect(r, config.run.name, args.rewards)
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0 if status["ledger"]["balanced"] else 1


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
