"""Seeded multiplication problems a 135M chat model cannot do in its head, for examples/calc_real.

Each row is {"id", "question", "answer", "expression"}: a two-digit by two-digit product
("What is 37 * 48?"). SmolLM2-135M-Instruct gets such products wrong when it answers directly
(37 * 48 -> "1844"), so a rewarded attempt has to go through the calculator.

    python -m examples.calc_real.tasks --out runs/calc-real-data --train 2000 --val 64 --seed 0
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from examples.calc.tasks import write_jsonl


def make_problem(rng: random.Random, task_id: str) -> dict:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    return {"id": task_id, "question": f"What is {a} * {b}?", "answer": a * b, "expression": f"{a} * {b}"}


def generate(split: str, n: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """`n` problems of `split`; each split draws from its own stream of the seed. Problems whose
    expression is in `exclude` are drawn again (main keeps validation products out of training:
    with 88 x 88 pairs, 2,000 training draws would otherwise hold about a quarter of them)."""
    rng = random.Random(f"calc_real:{split}:{seed}")
    problems: list[dict] = []
    while len(problems) < n:
        problem = make_problem(rng, f"{split}-{len(problems):05d}")
        if problem["expression"] not in exclude:
            problems.append(problem)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    val = generate("val", args.val, args.seed)
    write_jsonl(out / "val.jsonl", val)
    write_jsonl(
        out / "train.jsonl", generate("train", args.train, args.seed, frozenset(p["expression"] for p in val))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
