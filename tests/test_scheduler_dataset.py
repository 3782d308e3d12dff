"""Datasets: JSONL and Parquet (verl-style rows), split, seeded epoch order."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from squall.scheduler import dataset as ds
from squall.shared.errors import ConfigError


def verl_rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": f"what is {i}+{i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(n)
    ]


def test_parquet_verl_rows_come_through_unchanged(tmp_path):
    rows = verl_rows(5)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    samples = ds.load_rows(path)
    assert [s.sample_id for s in samples] == ["0", "1", "2", "3", "4"]
    assert samples[3].row["prompt"] == [{"role": "user", "content": "what is 3+3?"}]
    assert ds.ground_truth(samples[3].row) == "6"


def test_jsonl_ids_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "a", "answer": 1}) + "\n\n" + json.dumps({"q": 2}) + "\n")
    samples = ds.load_rows(path)
    assert [s.sample_id for s in samples] == ["a", "1"]
    assert ds.ground_truth(samples[0].row) == 1
    path.write_text("{not json}\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        ds.load_rows(path)
    with pytest.raises(ConfigError, match="does not exist"):
        ds.load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unknown format"):
        ds.load_rows(tmp_path / "x.csv")


def test_split_and_epoch_order_are_seeded():
    samples = [ds.Sample(str(i), {"i": i}) for i in range(20)]
    a = ds.split(samples, None, 0.25, seed=3)
    b = ds.split(samples, None, 0.25, seed=3)
    assert [s.sample_id for s in a.val] == [s.sample_id for s in b.val]
    assert len(a.val) == 5 and len(a.train) == 15
    assert {s.sample_id for s in a.val}.isdisjoint(s.sample_id for s in a.train)
    assert ds.epoch_order(10, 0, 1, True) == ds.epoch_order(10, 0, 1, True)
    assert ds.epoch_order(10, 0, 1, True) != ds.epoch_order(10, 1, 1, True)
    assert sorted(ds.epoch_order(10, 1, 1, True)) == list(range(10))
    assert ds.epoch_order(4, 0, 1, False) == [0, 1, 2, 3]
