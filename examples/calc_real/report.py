"""Per weight version: attempts, tool-call rate (calls that parsed), the rate of calls whose result
was the product, mean reward, solved attempts and the share of
rewarded attempts that went through the calculator, from the agent's log (CALC_REAL_LOG,
examples/calc_real/agent.py). The gateway hides weight versions from agents, so an attempt is
dated: it counts for the newest version the trainer had published when it ended (metrics.jsonl
of the run folder), an approximation that can credit a version with attempts its node served
just before loading it.

    python -m examples.calc_real.report runs/calc-real
"""

from __future__ import annotations

import bisect
import json
import sys
from collections import defaultdict
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def report(run_dir: str) -> str:
    folder = Path(run_dir)
    rows = read_jsonl(folder / "agent_log.jsonl")
    steps = sorted((m["time"], m["version"]) for m in read_jsonl(folder / "metrics.jsonl") if "time" in m)
    times = [t for t, _ in steps]
    lines = ["split version attempts call_rate right_call_rate mean_reward solved rewarded_via_tool"]
    for split in ("train", "val"):
        by_version: dict[int, list[dict]] = defaultdict(list)
        for row in rows:
            if row["id"].startswith(split):
                at = bisect.bisect_right(times, row["time"])
                by_version[steps[at - 1][1] if at else 0].append(row)
        for version, items in sorted(by_version.items()):
            n = len(items)
            rewarded = [r for r in items if r["reward"] > 0]
            via = sum(r["called"] for r in rewarded) / len(rewarded) if rewarded else float("nan")
            right = sum(r.get("right_call", False) for r in items) / n
            lines.append(
                f"{split} {version} {n} {sum(r['called'] for r in items) / n:.2f} {right:.2f} "
                f"{sum(r['reward'] for r in items) / n:.3f} {sum(r['reward'] == 1.0 for r in items)} {via:.2f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
