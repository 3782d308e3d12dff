"""Reading a run's progress out of Redis (for `squall up`) and drawing its learning curve."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import redis
from squall.shared import schemas
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger


def _reward_points(r: redis.Redis, keys: Keys) -> tuple[list[dict], list[dict]]:
    """The scheduler's `rewards` stream: train points per group, val points per round."""
    train, val = [], []
    for _, fields in r.xrange(keys.rewards):
        point = {k.decode(): v.decode() for k, v in fields.items()}
        try:
            entry = {"version": int(point["version"]), "mean": float(point["mean"]), "count": int(point.get("count", 0)),
                     "time": float(point.get("time", 0))}  # fmt: skip
        except (KeyError, ValueError):
            continue
        if math.isfinite(entry["mean"]):
            (val if point.get("mode") == "val" else train).append(entry)
    return train, val


def snapshot(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    ledger = Ledger(r, keys)
    versions = {k.decode(): int(v) for k, v in r.hgetall(keys.versions).items()}
    train, val = _reward_points(r, keys)
    last = r.xrevrange(keys.metrics, count=1)
    step, tokens_per_s = 0, 0.0
    if last:
        metrics = schemas.decode(last[0][1][schemas.ENTRY_FIELD], schemas.Metrics)
        step = metrics.step
        tokens_per_s = float(
            metrics.values.get("tokens_per_s", metrics.values.get("throughput/tokens_per_s", 0.0))
        )
    recent = train[-16:]
    train_reward = sum(p["mean"] for p in recent) / len(recent) if recent else float("nan")
    return {
        "ledger": ledger.counts(),
        "balanced": ledger.balanced(),
        "versions": versions,
        "train": train,
        "val": val,
        "step": step,
        "tokens_per_s": tokens_per_s,
        "train_reward": train_reward,
    }


def plot_curve(snap: dict[str, Any], path: Path) -> Path | None:
    """Train reward (per group, smoothed) and validation reward against weight version."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    by_version: dict[int, list[float]] = {}
    for point in snap["train"]:  # several groups share a version: one mean per version
        by_version.setdefault(point["version"], []).append(point["mean"])
    if by_version:
        xs = sorted(by_version)
        means = [sum(by_version[x]) / len(by_version[x]) for x in xs]
        ax.plot(xs, means, label="train reward (mean of groups)", color="tab:blue", alpha=0.7)
    if snap["val"]:
        ax.plot([p["version"] for p in snap["val"]], [p["mean"] for p in snap["val"]], "o-", label="validation reward",
                color="tab:orange")  # fmt: skip
    ax.set_xlabel("policy version")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("squall: calculator agent, GRPO on CPU")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
