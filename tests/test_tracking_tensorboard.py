"""`squall track` into TensorBoard, read back from the event files with TensorBoard's own
EventAccumulator: every metric, reward and ledger count at its step, samples decoded to
text, and a restarted tracker that logs only what is new. Also the tracker's own rules
(cursor, bad entries, bad config) and the `squall track` process end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from squall.shared.errors import ConfigError
from squall.shared.keys import Keys
from squall.tracking import stream_cursor as cursors
from squall.tracking.backends import make_backend
from squall.tracking.track import Tracker, tracking_dir
from tests.optional import installed, need
from tests.tracking_helpers import POLICY, publish_steps, tracking_config
from tests.waiting import wait_for

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _tensorboard():
    need("track", installed("tensorboard"), "tensorboard is not installed: pip install 'squall[track]'")


def read_events(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], list[tuple[int, str]]]:
    """(tag -> [(step, value)], [(step, samples markdown)]) of every event file in `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    texts = []
    for tag in tags["tensors"]:
        if tag.startswith("samples"):
            texts += [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
    return scalars, sorted(texts)


def test_metrics_rewards_ledger_and_samples_read_back(r, redis_url, run_name, tmp_path):
    keys = Keys(run_name)
    config = tracking_config(tmp_path, run_name, redis_url, ["tensorboard"], samples_per_version=2)
    published = publish_steps(r, keys, range(1, 4))
    tracker = Tracker(config, r)
    counts = tracker.poll()
    tracker.close()
    assert counts == {
        "metrics": 3,
        "rewards": len(published.train) + len(published.val),
        "ledger": 1,
        "samples": 6,
    }

    scalars, texts = read_events(tracking_dir(config) / "tensorboard")
    assert scalars["trainer/loss"] == [(s, pytest.approx(v["loss"])) for s, v in published.metrics.items()]
    assert scalars["trainer/filtered:zero_variance"] == [
        (s, v["filtered:zero_variance"]) for s, v in published.metrics.items()
    ]
    assert [(p.version, pytest.approx(p.mean)) for p in published.train] == scalars["reward/train"]
    assert [(p.version, pytest.approx(p.mean)) for p in published.val] == scalars["reward/val"]
    assert scalars["ledger/trained"] == [(3, 9.0)] and scalars["ledger/dispatched"] == [(3, 9.0)]
    # Two samples per version (the quota), each the first two attempts that version sampled.
    assert [step for step, _ in texts] == [0, 1, 2]
    for step, markdown in texts:
        sampled = [t for t in published.trajectories if t.min_version == step][:2]
        assert markdown.count("\n| ") == 2, markdown
        for t in sampled:
            prompt, rest = published.texts[t.key]
            assert t.key in markdown
            assert prompt.replace("\n", "<br>").replace("|", "\\|") in markdown
            assert rest.replace("\n", "<br>").replace("|", "\\|") in markdown


def test_restart_logs_only_what_is_new(r, redis_url, run_name, tmp_path):
    keys = Keys(run_name)
    config = tracking_config(tmp_path, run_name, redis_url, ["tensorboard"], samples_per_version=1)
    published = publish_steps(r, keys, range(1, 3))
    first = Tracker(config, r)
    first.poll()
    assert first.poll() == {}  # nothing new: nothing logged
    first.close()

    publish_steps(r, keys, range(3, 5), into=published)
    second = Tracker(config, r)  # a restart: the cursor file says where the first one stopped
    counts = second.poll()
    second.close()
    assert counts["metrics"] == 2 and counts["samples"] == 2 and counts["ledger"] == 1
    scalars, texts = read_events(tracking_dir(config) / "tensorboard")
    assert [s for s, _ in scalars["trainer/loss"]] == [1, 2, 3, 4]  # each step once
    assert [v for v, _ in scalars["reward/train"]] == [p.version for p in published.train]
    assert [s for s, _ in scalars["ledger/trained"]] == [2, 4]
    assert [s for s, _ in texts] == [0, 1, 2, 3]


def test_bad_entries_are_skipped_and_counted(r, redis_url, run_name, tmp_path):
    keys = Keys(run_name)
    config = tracking_config(tmp_path, run_name, redis_url, ["tensorboard"], samples_per_version=0)
    r.xadd(keys.metrics, {"m": b"not msgpack"})
    r.xadd(keys.rewards, {"other": b"field"})
    publish_steps(r, keys, range(1, 2))
    tracker = Tracker(config, r)
    counts = tracker.poll()
    tracker.close()
    assert tracker.skipped == 2
    assert counts["metrics"] == 1 and "samples" not in counts  # samples_per_version = 0: none


def test_cursor_of_another_run_and_bad_config_are_refused(r, redis_url, run_name, tmp_path):
    config = tracking_config(tmp_path, run_name, redis_url, ["tensorboard"])
    cursors.save(tracking_dir(config), cursors.Cursor(run="other"))
    with pytest.raises(ConfigError, match="belongs to run 'other'"):
        Tracker(config, r)
    (tracking_dir(config) / cursors.CURSOR_FILE).unlink()
    with pytest.raises(ConfigError, match="tracking.backends is empty"):
        Tracker(tracking_config(tmp_path, run_name, redis_url, []), r)
    with pytest.raises(ConfigError, match="known are wandb, tensorboard, mlflow"):
        make_backend("neptune", config, tmp_path, {})
    no_tokenizer = config.model_copy(
        update={"model": config.model.model_copy(update={"path": str(tmp_path / "none")})}
    )
    with pytest.raises(ConfigError, match="samples_per_version = 0"):
        Tracker(no_tokenizer, r)


@pytest.mark.slow
def test_squall_track_process_follows_then_drains_on_sigterm(r, redis_url, run_name, tmp_path):
    """The real command: it logs what arrives while it runs, and on SIGTERM one last poll."""
    keys = Keys(run_name)
    config = tracking_config(tmp_path, run_name, redis_url, ["tensorboard"], poll_s=0.2)
    env = {**os.environ, "SQUALL_RUN__REDIS_URL": redis_url, "SQUALL_RUN__DIR": config.run.dir,
           "SQUALL_MODEL__PATH": str(POLICY), "SQUALL_TRACKING__POLL_S": "0.2"}  # fmt: skip
    cmd = [sys.executable, "-m", "squall.cli", "track", "--run", run_name, "--backend", "tensorboard"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        publish_steps(r, keys, range(1, 3))
        cursor_file = tmp_path / "run" / "tracking" / cursors.CURSOR_FILE
        wait_for(
            lambda: cursor_file.exists() and '"metrics"' in cursor_file.read_text(),
            60,
            "the tracker's first poll",
        )
        publish_steps(r, keys, range(3, 4))  # may land just before the signal: the last poll drains it
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    scalars, _ = read_events(tmp_path / "run" / "tracking" / "tensorboard")
    assert [s for s, _ in scalars["trainer/loss"]] == [1, 2, 3]
    assert '"tracker_stopped"' in err
