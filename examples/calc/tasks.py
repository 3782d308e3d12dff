"""Seeded generator of arithmetic word problems for the calculator-agent demo.

Each row is {"id", "question", "answer", "expression"}: `answer` is an int (the reward checks the
last integer of the agent's final message against it), `expression` the arithmetic that solves
it ("37+58"), used by the warm-start data. Operands have 2-3 digits; subtraction never goes
negative. The same seed always gives the same rows.

    python -m examples.calc.tasks --out data/calc --train 2000 --val 200 --seed 0

writes train.jsonl and val.jsonl (ids `train-00000`, `val-00000`, ...; the two splits draw from
independent streams of the seed, so changing --train does not change the validation set).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

NAMES = ("Tom", "Ana", "Lee", "Mia", "Sam", "Kai", "Zoe", "Ben", "Eva", "Max")
THINGS = ("apples", "books", "coins", "cards", "stamps", "pens", "eggs", "shells", "marbles", "stickers")

# (operator, template); {a} and {b} are the operands in the order the expression uses them.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("+", "{name} has {a} {things} and buys {b} more. How many {things} does {name} have now?"),
    ("+", "A shop sold {a} {things} on Monday and {b} on Tuesday. How many {things} did it sell in total?"),
    ("-", "{name} had {a} {things} and gave away {b}. How many {things} are left?"),
    ("-", "There are {a} {things} in a box. {name} takes out {b}. How many {things} remain in the box?"),
    ("*", "{name} buys {a} bags with {b} {things} in each bag. How many {things} is that in total?"),
    ("*", "Each of {a} kids gets {b} {things}. How many {things} are given out?"),
)


def make_problem(rng: random.Random, task_id: str) -> dict:
    """One problem drawn from `rng`."""
    op, template = rng.choice(TEMPLATES)
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    if op == "-" and b > a:
        a, b = b, a
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = template.format(name=rng.choice(NAMES), things=rng.choice(THINGS), a=a, b=b)
    return {"id": task_id, "question": question, "answer": answer, "expression": f"{a}{op}{b}"}


def generate(split: str, n: int, seed: int) -> list[dict]:
    """`n` problems of `split` ("train" or "val"); each split has its own stream of the seed."""
    rng = random.Random(f"calc:{split}:{seed}")
    return [make_problem(rng, f"{split}-{i:05d}") for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write calculator word problems as train/val JSONL.")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--train", type=int, default=2000, help="number of training problems")
    parser.add_argument("--val", type=int, default=200, help="number of validation problems")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", generate("train", args.train, args.seed))
    write_jsonl(out / "val.jsonl", generate("val", args.val, args.seed))
    print(f"wrote {args.train} train and {args.val} val problems to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
