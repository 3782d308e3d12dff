"""`squall track` into W&B in offline mode, read back from the run's own files: the history
records of the `.wandb` log (framed as a LevelDB log: 32 KiB blocks of records with a 7-byte
header, each a protobuf `Record`) and the samples table W&B writes as JSON."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from squall.shared.keys import Keys
from squall.tracking.track import Tracker, tracking_dir
from tests.optional import installed, need
from tests.tracking_helpers import publish_steps, tracking_config
from tests.waiting import wait_for

pytestmark = pytest.mark.redis

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@pytest.fixture(autouse=True)
def _wandb(monkeypatch):
    need("track", installed("wandb"), "wandb is not installed: pip install 'squall[track]'")
    monkeypatch.setenv("WANDB_SILENT", "true")


def log_records(path: Path) -> list[bytes]:
    """The records of one `.wandb` file: a 7-byte `:W&B` header, then LevelDB log framing."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunks, out = 7, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            out.append(chunks)
            chunks = b""
    return out


def history(folder: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        for raw in log_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


def settled_history(folder: Path, key: str, n: int) -> list[dict]:
    """The history once `key` was logged `n` times: W&B's service process may still be writing
    the log when finish() returns in offline mode."""
    return wait_for(
        lambda: (rows := history(folder)) and sum(key in row for row in rows) >= n and rows,
        30,
        f"{n} rows of {key}",
    )


def series(rows: list[dict], key: str, axis: str) -> list[tuple[int, float]]:
    return [(row[axis], row[key]) for row in rows if key in row]


def test_offline_run_holds_metrics_rewards_ledger_and_samples(r, redis_url, run_name, tmp_path):
    keys = Keys(run_name)
    config = tracking_config(
        tmp_path, run_name, redis_url, ["wandb"], wandb_mode="offline", samples_per_version=2
    )
    published = publish_steps(r, keys, range(1, 4))
    tracker = Tracker(config, r)
    tracker.poll()
    tracker.close()
    folder = tracking_dir(config)
    rows = settled_history(folder, "samples/path", 3)
    assert series(rows, "trainer/loss", "trainer/step") == [
        (s, pytest.approx(v["loss"])) for s, v in published.metrics.items()
    ]
    assert series(rows, "reward/train", "version") == [
        (p.version, pytest.approx(p.mean)) for p in published.train
    ]
    assert series(rows, "reward/val", "version") == [
        (p.version, pytest.approx(p.mean)) for p in published.val
    ]
    assert series(rows, "ledger/trained", "version") == [(3, 9)]
    tables = [row for row in rows if "samples" in row or "samples/path" in row]
    assert [row["version"] for row in tables] == [0, 1, 2]
    run_dir = next(folder.glob("wandb/offline-run-*"))
    for row in tables:
        table = json.loads((run_dir / "files" / row["samples/path"]).read_text())
        columns, data = table["columns"], table["data"]
        assert [dict(zip(columns, cells, strict=True))["attempt"] for cells in data] == [
            t.key for t in published.trajectories if t.min_version == row["version"]
        ][:2]
        for cells in data:
            sample = dict(zip(columns, cells, strict=True))
            assert (sample["prompt"], sample["response"]) == published.texts[sample["attempt"]]


def test_restart_resumes_the_same_wandb_run(r, redis_url, run_name, tmp_path):
    keys = Keys(run_name)
    config = tracking_config(
        tmp_path, run_name, redis_url, ["wandb"], wandb_mode="offline", samples_per_version=0
    )
    publish_steps(r, keys, range(1, 3))
    first = Tracker(config, r)
    first.poll()
    first.close()
    run_id = first.cursor.backends["wandb"]["id"]
    publish_steps(r, keys, range(3, 4))
    second = Tracker(config, r)
    second.poll()
    second.close()
    assert second.cursor.backends["wandb"]["id"] == run_id
    folder = tracking_dir(config)
    # Two offline run folders (one per start), both of the one W&B run `wandb sync` will merge.
    assert {p.name for p in folder.glob("wandb/offline-run-*/run-*.wandb")} == {f"run-{run_id}.wandb"}
    assert len(list(folder.glob("wandb/offline-run-*"))) == 2
    rows = settled_history(folder, "trainer/loss", 3)
    assert [s for s, _ in series(rows, "trainer/loss", "trainer/step")] == [1, 2, 3]
