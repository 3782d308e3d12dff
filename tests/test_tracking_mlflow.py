"""`squall track` into MLflow's file store, read back with `MlflowClient`: metric histories
at their steps, the run config as params (no secrets), samples as JSON-lines artifacts, and a
restarted tracker appending to the same MLflow run without repeating a point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from squall.shared.keys import Keys
from squall.tracking.mlflow_backend import metric_key, store_uri
from squall.tracking.track import Tracker, tracking_dir
from tests.optional import installed, need
from tests.tracking_helpers import publish_steps, tracking_config

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _mlflow():
    need("track", installed("mlflow"), "mlflow is not installed: pip install 'squall[track]'")


def client_for(config):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store_uri(config, tracking_dir(config)))


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_file_store_holds_metrics_params_and_samples(r, redis_url, run_name, tmp_path):
    keys = Keys(run_name)
    config = tracking_config(tmp_path, run_name, redis_url, ["mlflow"], samples_per_version=2)
    published = publish_steps(r, keys, range(1, 4))
    tracker = Tracker(config, r)
    tracker.poll()
    tracker.close()
    assert (tracking_dir(config) / "mlruns").is_dir()

    client = client_for(config)
    experiment = client.get_experiment_by_name("squall")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == run_name and run.info.status == "FINISHED"
    run_id = run.info.run_id
    assert history(client, run_id, "trainer/loss") == [
        (s, pytest.approx(v["loss"])) for s, v in published.metrics.items()
    ]
    # ':' is not allowed in an MLflow key: the trainer's `filtered:<reason>` counts keep their name otherwise.
    assert metric_key("trainer/filtered:zero_variance") == "trainer/filtered_zero_variance"
    assert history(client, run_id, "trainer/filtered_zero_variance") == [
        (s, v["filtered:zero_variance"]) for s, v in published.metrics.items()
    ]
    assert history(client, run_id, "reward/val") == [
        (p.version, pytest.approx(p.mean)) for p in published.val
    ]
    assert sorted(v for _, v in history(client, run_id, "reward/train")) == pytest.approx(
        sorted(p.mean for p in published.train)
    )
    assert history(client, run_id, "ledger/trained") == [(3, 9.0)]
    assert run.data.params["trainer.lr"] == json.dumps(config.trainer.lr)
    assert run.data.params["tracking.backends"] == '["mlflow"]'

    files = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert [Path(f).name[:7] for f in files] == ["v000000", "v000001", "v000002"]
    local = Path(client.download_artifacts(run_id, "samples", str(tmp_path / "dl")))
    rows = [json.loads(line) for f in sorted(local.iterdir()) for line in f.read_text().splitlines()]
    assert [row["attempt"] for row in rows] == [
        t.key for v in (0, 1, 2) for t in [t for t in published.trajectories if t.min_version == v][:2]
    ]
    for row in rows:
        assert (row["prompt"], row["response"]) == published.texts[row["attempt"]]


def test_params_hide_the_redis_password(r, redis_url, run_name, tmp_path):
    host = redis_url.split("//", 1)[1]
    config = tracking_config(
        tmp_path, run_name, f"redis://user:hunter2@{host}", ["mlflow"], samples_per_version=0
    )
    tracker = Tracker(config, r)  # the config is only logged: this tracker never reads Redis
    tracker.close()
    client = client_for(config)
    (run,) = client.search_runs([client.get_experiment_by_name("squall").experiment_id])
    assert "hunter2" not in json.dumps(run.data.params)
    assert host.split("/")[0] in run.data.params["run.redis_url"]


def test_restart_appends_to_the_same_run(r, redis_url, run_name, tmp_path):
    keys = Keys(run_name)
    config = tracking_config(tmp_path, run_name, redis_url, ["mlflow"], samples_per_version=0)
    publish_steps(r, keys, range(1, 3))
    first = Tracker(config, r)
    first.poll()
    first.close()
    publish_steps(r, keys, range(3, 5))
    second = Tracker(config, r)
    second.poll()
    second.close()
    client = client_for(config)
    runs = client.search_runs([client.get_experiment_by_name("squall").experiment_id])
    assert [run.info.run_id for run in runs] == [first.cursor.backends["mlflow"]["run_id"]]
    assert [s for s, _ in history(client, runs[0].info.run_id, "trainer/loss")] == [1, 2, 3, 4]
