"""`squall rescore --run R --reward mymod:fn`: a new reward function applied to kept attempts.

The cheap way to debug a reward: no model is called. Each kept attempt that finished ok
(monitor.rollouts: the run folder's sample, plus the live stream with `--live`) is scored
again with `fn(task, final_answer)` (the `runner.reward_fn` contract; sync or async), and a
report compares the rewards before and after, overall and by weight version: count, mean,
std, quantiles, the distinct values when there are few, and how many changed. The report is
printed and written as JSON (`--out`, default `<run.dir>/rescore/<module>.<fn>-<UTC time>.json`).

Attempts that did not finish ok are left out (counted in `skipped`); a reward function that
raises or returns something that is not a finite number on one attempt is an error for that
attempt (counted, the first ones quoted), not the end of the report.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from squall.shared.cliargs import add_common_arguments

DISTINCT_SHOWN = 10  # a distribution with at most this many distinct values lists them
ERRORS_QUOTED = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument(
        "--reward",
        required=True,
        metavar="MODULE:FN",
        help="the reward function, fn(task: dict, final_answer: str | None) -> float",
    )
    parser.add_argument("--run-dir", help="the run folder holding rollouts/ (default: run.dir of the config)")
    parser.add_argument(
        "--id",
        action="append",
        default=[],
        metavar="KEY",
        help="only this attempt (`<group>:<index>#<attempt>`); repeatable",
    )
    parser.add_argument("--live", action="store_true", help="also the attempts still in the run's Redis")
    parser.add_argument("--out", help="where to write the JSON report")


def distribution(values: list[float]) -> dict[str, Any]:
    """Count, mean, population std, min, p10, p50, p90, max; the values themselves when few."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * (len(ordered) - 1) + 0.5))]

    out: dict[str, Any] = {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": ordered[0],
        "p10": q(0.1),
        "p50": q(0.5),
        "p90": q(0.9),
        "max": ordered[-1],
    }
    distinct = sorted(set(values))
    if len(distinct) <= DISTINCT_SHOWN:
        out["values"] = {repr(v): values.count(v) for v in distinct}
    return out


def _compare(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    before, after = [b for b, _ in pairs], [a for _, a in pairs]
    changed = sum(1 for b, a in pairs if not math.isclose(b, a, rel_tol=1e-9, abs_tol=1e-12))
    delta = statistics.fmean(a - b for b, a in pairs) if pairs else None
    return {
        "before": distribution(before),
        "after": distribution(after),
        "changed": changed,
        "mean_delta": delta,
    }


def _score(fn: Any, payload: dict[str, Any], final_answer: str | None) -> float:
    value = fn(payload, final_answer)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"returned {type(value).__name__} {str(value)[:80]!r}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, not a finite number")
    return float(value)


async def _await(value: Any) -> Any:
    return await value


def rescore(rollouts: list[Any], fn: Any) -> dict[str, Any]:
    """The report for `rollouts` (monitor.rollouts.Rollout) scored again with `fn`."""
    pairs: dict[int, list[tuple[float, float]]] = {}
    skipped: dict[str, int] = {}
    errors: list[dict[str, str]] = []
    attempts = []
    for rollout in rollouts:
        t = rollout.trajectory
        if t.status != "ok" or t.reward is None:
            skipped[f"status {t.status}"] = skipped.get(f"status {t.status}", 0) + 1
            continue
        if rollout.payload is None:
            skipped["no task payload kept"] = skipped.get("no task payload kept", 0) + 1
            continue
        try:
            after = _score(fn, rollout.payload, t.final_answer)
        except Exception as exc:  # the user's function: report it per attempt, keep going
            errors.append({"key": t.key, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        pairs.setdefault(rollout.version, []).append((t.reward, after))
        attempts.append({"key": t.key, "version": rollout.version, "before": t.reward, "after": after})
    everything = [p for version in sorted(pairs) for p in pairs[version]]
    return {
        "attempts": len(rollouts),
        "scored": len(everything),
        "skipped": skipped,
        "errors": len(errors),
        "error_examples": errors[:ERRORS_QUOTED],
        "overall": _compare(everything),
        "by_version": {str(v): _compare(pairs[v]) for v in sorted(pairs)},
        "rescored": attempts,
    }


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"


def render(report: dict[str, Any]) -> str:
    lines = [
        f"rescore of run {report['run']} with {report['reward']}: {report['scored']} of {report['attempts']} "
        f"attempts scored, {report['errors']} errors"
        + (f", skipped {report['skipped']}" if report["skipped"] else ""),
        f"{'version':>8} {'n':>6} {'before mean':>12} {'after mean':>12} {'changed':>8}",
    ]
    for name, part in [*report["by_version"].items(), ("all", report["overall"])]:
        before, after = part["before"], part["after"]
        lines.append(
            f"{name:>8} {before['n']:>6} {_fmt(before.get('mean')):>12} {_fmt(after.get('mean')):>12} "
            f"{part['changed']:>8}"
        )
    for error in report["error_examples"][:5]:
        lines.append(f"error    {error['key']}: {error['error']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from squall.runner.agents import load_callable
    from squall.shared.cliargs import config_from_args
    from squall.shared.errors import ConfigError
    from squall.shared.keys import Keys

    from .rollouts import read_all

    config = config_from_args(args)
    if os.getcwd() not in sys.path:
        sys.path.insert(
            0, os.getcwd()
        )  # `mymod:fn` in the folder the command runs in, as `python -m` finds it
    try:
        fn = load_callable(args.reward, "--reward")
    except ConfigError as exc:
        print(f"squall rescore: {exc}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or config.run.dir
    r = None
    if args.live:
        from squall.shared.runlookup import find_run_for

        r = find_run_for(args, config, "rescore")
        if r is None:
            return 2
    rollouts = read_all(run_dir if Path(run_dir).is_dir() else None, r, Keys(config.run.name) if r else None)
    if not rollouts:
        print(
            f"squall rescore: no kept attempts of run {config.run.name!r} in {Path(run_dir) / 'rollouts'}"
            f"{' or its Redis' if args.live else ''}: pass the run folder with --run-dir (the scheduler keeps "
            "scheduler.keep_rollouts_per_version attempts per version there)",
            file=sys.stderr,
        )
        return 2
    if args.id:
        known = {x.key for x in rollouts}
        missing = [key for key in args.id if key not in known]
        if missing:
            print(
                f"squall rescore: no kept attempt {', '.join(map(repr, missing))} in {run_dir} "
                f"({len(rollouts)} kept; ids look like `<group>:<index>#<attempt>`, listed by "
                "`squall show trajectories`)",
                file=sys.stderr,
            )
            return 2
        rollouts = [x for x in rollouts if x.key in set(args.id)]
    report = {
        "run": config.run.name,
        "reward": args.reward,
        "run_dir": str(run_dir),
        "time": time.time(),
        **rescore(rollouts, fn),
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = (
        Path(args.out)
        if args.out
        else Path(run_dir) / "rescore" / f"{args.reward.replace(':', '.')}-{stamp}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"report: {out}")
    return 0
