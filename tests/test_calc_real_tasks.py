"""examples/calc_real/tasks.py: the data files keep validation products out of training, and the
same seed writes the same files."""

from __future__ import annotations

import json

from examples.calc_real.tasks import main


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_training_problems_never_repeat_a_validation_product(tmp_path):
    assert main(["--out", str(tmp_path / "a"), "--train", "3000", "--val", "64", "--seed", "1"]) == 0
    train, val = read(tmp_path / "a" / "train.jsonl"), read(tmp_path / "a" / "val.jsonl")
    assert len(train) == 3000 and len(val) == 64
    assert not {p["expression"] for p in val} & {p["expression"] for p in train}
    assert all(p["answer"] == eval(p["expression"]) for p in train + val)  # noqa: S307 (our own "a * b")
    main(["--out", str(tmp_path / "b"), "--train", "3000", "--val", "64", "--seed", "1"])
    assert read(tmp_path / "b" / "train.jsonl") == train
