"""Per weight version: attempts, tool-call rate, mean reward and the share of rewarded attempts
that went through the calculator, from the agent's log (CALC_REAL_LOG, examples/calc_real/agent.py).

    python -m examples.calc_real.report runs/calc-real/agent_log.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def report(path: str) -> str:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    lines = ["split version attempts call_rate mean_reward solved rewarded_via_tool"]
    for split in ("train", "val"):
        by_version: dict[int, list[dict]] = defaultdict(list)
        for row in rows:
            if row["id"].startswith(split):
                by_version[row["version"] if row["version"] is not None else -1].append(row)
        for version, items in sorted(by_version.items()):
            n = len(items)
            called = sum(r["called"] for r in items)
            rewarded = [r for r in items if r["reward"] > 0]
            solved = sum(r["reward"] == 1.0 for r in items)
            via = sum(r["called"] for r in rewarded) / len(rewarded) if rewarded else float("nan")
            mean = sum(r["reward"] for r in items) / n
            lines.append(f"{split} {version} {n} {called / n:.2f} {mean:.3f} {solved} {via:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
