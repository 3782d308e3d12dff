"""Seeded word problems for the code-interpreter example (ReTool-like): the calculator demo's
generator (examples/calc/tasks.py) on a stream of its own, so the two examples' data differ.

    python -m examples.code.tasks --out runs/code-data --train 2000 --val 200 --seed 0
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from examples.calc.tasks import make_problem, write_jsonl


def generate(split: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(f"code:{split}:{seed}")
    return [make_problem(rng, f"code-{split}-{i:05d}") for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write code-interpreter word problems as train/val JSONL.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", generate("train", args.train, args.seed))
    write_jsonl(out / "val.jsonl", generate("val", args.val, args.seed))
    print(f"wrote {args.train} train and {args.val} val problems to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
