"""Reading a run's progress out of Redis (for `squall up`) and drawing its learning curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from squall.monitor.snapshot_json import render as render_snapshot
from squall.shared.keys import Keys
from squall.shared.runstate import RunSnapshot, read_snapshot

RECENT_GROUPS = 16  # train groups averaged into the progress line's train_reward


def render(snap: RunSnapshot) -> dict[str, Any]:
    """The run as `squall up` prints and saves it: the snapshot in its one JSON shape
    (monitor/snapshot_json.py), plus the newest step, its throughput, the recent train reward
    and the trainer's last version at the data's end."""
    recent = snap.train_rewards[-RECENT_GROUPS:]
    last = snap.metrics.last
    return {
        **render_snapshot(snap),
        "step": last.step if last is not None else 0,
        "tokens_per_s": snap.metrics.latest("tokens_per_s", "throughput/tokens_per_s"),
        "train_reward": sum(p.mean for p in recent) / len(recent) if recent else float("nan"),
        "last_version": snap.end.trainer_version if snap.end is not None else None,  # trainer's, at data end
    }


def sampled_tokens(snap: dict[str, Any]) -> int:
    """Tokens the run's inference nodes have generated since they started: the sum of their
    heartbeats' `sampled_tokens` (an engine that does not count them adds 0)."""
    return sum(
        int(p["fields"].get("sampled_tokens") or 0) for p in snap["heartbeats"] if p["service"] == "inference"
    )


class GenerationRate:
    """Generated tokens per second between two progress lines (None before the second one, or
    when a node restarted and its count went back)."""

    def __init__(self) -> None:
        self.last: tuple[float, int] | None = None

    def update(self, now: float, tokens: int) -> float | None:
        previous, self.last = self.last, (now, tokens)
        if previous is None or tokens < previous[1] or now <= previous[0]:
            return None
        return (tokens - previous[1]) / (now - previous[0])


def snapshot(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Every reward point (the whole curve) and only the newest metrics message."""
    return render(read_snapshot(r, keys, rewards=None, metrics=1, recent=0))


def role_summaries(snap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`summary.json`'s `roles`: per trained role, its validation reward at the first and last
    round, its curves and its last version."""
    out = {}
    for name, role in snap["roles"].items():
        val = role["rewards"]["val"]
        out[name] = {
            "val_reward_start": val[0]["mean"] if val else None,
            "val_reward_end": val[-1]["mean"] if val else None,
            "val_reward_end_version": val[-1]["version"] if val else None,
            "last_version": role["version"],
            "val_curve": val,
            "train_curve": role["rewards"]["train"],
        }
    return out


def plot_curve(snap: dict[str, Any], path: Path, title: str = "squall: GRPO") -> Path | None:
    """Train reward (per group, smoothed) and validation reward against weight version."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    by_version: dict[int, list[float]] = {}
    for point in snap["rewards"]["train"]:  # several groups share a version: one mean per version
        by_version.setdefault(point["version"], []).append(point["mean"])
    if by_version:
        xs = sorted(by_version)
        means = [sum(by_version[x]) / len(by_version[x]) for x in xs]
        ax.plot(xs, means, label="train reward (mean of groups)", color="tab:blue", alpha=0.7)
    if snap["rewards"]["val"]:
        ax.plot(
            [p["version"] for p in snap["rewards"]["val"]],
            [p["mean"] for p in snap["rewards"]["val"]],
            "o-",
            label="validation reward",
            color="tab:orange",
        )
    colors = iter(["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"])
    for name, role in snap.get("roles", {}).items():  # several trained roles: each one's val curve
        points = role["rewards"]["val"]
        if points:
            ax.plot(
                [p["version"] for p in points],
                [p["mean"] for p in points],
                "s--",
                label=f"{name}: validation reward",
                color=next(colors, "tab:gray"),
            )
    ax.set_xlabel("policy version")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
