"""The dashboard: /api/state over a real Redis filled with real messages, and the page itself
opened in headless Chromium (Debian's `chromium`, driven by Playwright) during a short
synthetic run; it must show the ledger and the curves and follow the run live.

The screenshot lands in test-artifacts/dashboard.png."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from optional import installed, need

from squall.monitor.snapshot_json import snapshot
from squall.shared import bus, schemas
from squall.shared.keys import GROUP_RUNNERS, GROUP_SCHEDULER, GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import free_port
from squall.shared.runwarnings import RunWarning, record_once

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip


def _task(run: str, group: int, index: int, attempt: int = 0) -> schemas.Task:
    return schemas.Task(
        run=run, task_id=f"g{group}:{index}", group_id=f"g{group}", sample_id=f"s{group}", index=index,
        group_size=4, attempt=attempt, payload={"question": "1+1"}, deadline=time.time() + 60,
    )  # fmt: skip


def _trajectory(task: schemas.Task, reward: float) -> schemas.Trajectory:
    return schemas.Trajectory(
        run=task.run, task_id=task.task_id, group_id=task.group_id, sample_id=task.sample_id, index=task.index,
        group_size=task.group_size, attempt=task.attempt, runner_id="runner-1:0", status="ok", reward=reward,
    )  # fmt: skip


class SyntheticRun:
    """Writes what the four services write, through the same shared/ primitives they use."""

    def __init__(self, r: redis.Redis, run: str) -> None:
        self.r, self.run, self.keys = r, run, Keys(run)
        self.ledger = Ledger(r, self.keys)
        self.group = 0
        self.version = 0
        for stream in (self.keys.tasks, self.keys.trajectories):
            for group in self.keys.groups_of(stream):
                bus.ensure_group(r, stream, group)
        self.runners = bus.GroupConsumer(r, self.keys.tasks, GROUP_RUNNERS, "runner-1:0", kind=schemas.Task,
                                         deadletter_stream=self.keys.deadletter)  # fmt: skip
        self.trainer = bus.GroupConsumer(r, self.keys.trajectories, GROUP_TRAINER, "trainer-0",
                                         kind=schemas.Trajectory, deadletter_stream=self.keys.deadletter)  # fmt: skip

    def beat(self) -> None:
        now = time.time()
        for name, body in {
            "scheduler:0": {"samples": self.group},
            "trainer:0": {"version": self.version},
            "runner:host-a:1": {"busy": 2, "slots": 4},
            "runner:host-a:2": {"busy": 1, "slots": 4},
            "inference:node-a": {"version": self.version},
        }.items():
            self.r.hset(self.keys.heartbeats, name, json.dumps({"time": now, **body}))
        self.r.hset(self.keys.heartbeats, "runner:host-b:1", json.dumps({"time": now - 120}))  # a dead one

    def step(self) -> None:
        """One group dispatched, run and trained; then a new version is published and applied."""
        tasks = [_task(self.run, self.group, i) for i in range(4)]
        bus.publish_many(self.r, self.keys.tasks, tasks)
        self.ledger.move([t.key for t in tasks], "pending", allowed_from=["new"])
        deliveries = self.runners.read(4, block_ms=100)
        self.ledger.move([d.message.key for d in deliveries], "running")
        rewards = [0.2 + 0.1 * self.group + 0.05 * d.message.index for d in deliveries]
        for delivery, reward in zip(deliveries, rewards, strict=True):
            bus.publish(self.r, self.keys.trajectories, _trajectory(delivery.message, reward))
            self.ledger.move([delivery.message.key], "ok")
        self.runners.ack([d.entry_id for d in deliveries])
        trained = self.trainer.read(4, block_ms=100)
        self.ledger.move([d.message.key for d in trained[:3]], "trained")
        self.ledger.filtered([d.message.key for d in trained[3:]], "overlong")
        self.trainer.ack([d.entry_id for d in trained])
        mean = sum(rewards) / len(rewards)
        bus.publish(self.r, self.keys.rewards, schemas.RewardPoint(
            run=self.run, version=self.version, mode="train", mean=mean, count=4, group_id=f"g{self.group}"))  # fmt: skip
        if self.group % 2 == 1:
            bus.publish(self.r, self.keys.rewards, schemas.RewardPoint(
                run=self.run, version=self.version, mode="val", mean=mean - 0.05, count=8,
                group_id=f"round{self.group}"))  # fmt: skip
        self.version += 1
        bus.publish(self.r, self.keys.metrics, schemas.Metrics(
            run=self.run, step=self.version, version=self.version,
            values={"reward_mean": mean, "loss": 1.0 / (1 + self.version), "kl": 0.01 * self.version,
                    "tokens_per_s": 900.0 + 10 * self.version},
        ), maxlen=1000)  # fmt: skip
        self.r.hset(self.keys.versions, mapping={"trainer": self.version, "inference:node-a": self.version,
                                                 "inference:node-b": max(0, self.version - 2)})  # fmt: skip
        bus.publish(self.r, self.keys.events, schemas.Event(run=self.run, service="trainer",
                                                            name="weights_published", fields={"version": self.version}))  # fmt: skip
        self.group += 1
        self.beat()

    def leave_some_in_flight(self) -> None:
        tasks = [_task(self.run, 99, i) for i in range(4)]
        bus.publish_many(self.r, self.keys.tasks, tasks)
        self.ledger.move([t.key for t in tasks], "pending", allowed_from=["new"])
        self.r.xadd(self.keys.tasks, {"m": b"\x93not a task"})  # malformed: a runner dead-letters it


def test_snapshot_reads_a_synthetic_run(r, run_name):
    run = SyntheticRun(r, run_name)
    for _ in range(5):
        run.step()
    run.leave_some_in_flight()
    r.xadd(Keys(run_name).rewards, {"version": "junk", "mode": "train", "mean": "nan"})  # skipped, not fatal
    r.xadd(Keys(run_name).metrics, {"m": b"garbage"})
    state = snapshot(r, Keys(run_name))
    json.dumps(state, allow_nan=False)  # JSON-clean: no NaN reaches the browser

    ledger = state["ledger"]
    assert ledger["dispatched"] == 24 and ledger["balanced"]
    assert ledger["counts"] == {"trained": 15, "filtered:overlong": 5, "pending": 4}
    assert ledger["in_flight"] == 4
    groups = {(g["stream"], g["group"]): g for g in state["groups"]}
    assert groups[("tasks", GROUP_RUNNERS)]["lag"] == 5  # 4 tasks + the malformed entry undelivered
    assert groups[("trajectories", GROUP_TRAINER)]["pending"] == 0
    assert groups[("trajectories", GROUP_SCHEDULER)]["lag"] == 20
    assert [p["version"] for p in state["rewards"]["train"]] == [0, 1, 2, 3, 4]
    assert [p["version"] for p in state["rewards"]["val"]] == [1, 3]
    assert state["skipped"] == {"rewards": 1, "metrics": 1}
    assert math.isclose(state["rewards"]["train"][0]["mean"], 0.275)
    assert [s[0] for s in state["metrics"]["series"]["loss"]] == [1, 2, 3, 4, 5]
    assert state["metrics"]["last"]["step"] == 5
    assert state["versions"]["trainer"] == 5 and state["versions"]["max_behind"] == 2
    alive = {h["id"]: h["alive"] for h in state["heartbeats"]}
    assert alive["runner:host-a:1"] and not alive["runner:host-b:1"]
    assert state["events"][0]["name"] == "weights_published"


def _start_dashboard(redis_url: str, run: str, port: int, api_key: str = "") -> subprocess.Popen:
    env = {**os.environ, "SQUALL_DASHBOARD_API_KEY": api_key}
    proc = subprocess.Popen(
        [sys.executable, "-m", "squall.cli", "dashboard", "--run", run, "--redis-url", redis_url, "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"dashboard exited: {proc.stdout.read().decode() if proc.stdout else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("dashboard did not answer /health within 20 s")


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=5)
    return out.decode() if out else ""


@pytest.mark.slow
def test_dashboard_http_api_key_and_metrics(r, redis_url, run_name):
    SyntheticRun(r, run_name).step()
    port = free_port()
    proc = _start_dashboard(redis_url, run_name, port, api_key="s3cret-key")
    try:
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/api/state").status_code == 401
        assert httpx.get(f"{base}/metrics").status_code == 401
        state = httpx.get(f"{base}/api/state", headers={"Authorization": "Bearer s3cret-key"}).json()
        assert state["ledger"]["dispatched"] == 4
        metrics = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer s3cret-key"}).text
        assert 'squall_ledger_attempts{state="trained"} 3.0' in metrics
        assert 'squall_queue_lag_entries{group="scheduler",stream="trajectories"} 4.0' in metrics
        page = httpx.get(f"{base}/")
        assert page.status_code == 200 and "<svg" not in page.text.split("<script>")[0]
        assert "http://" not in page.text and "https://" not in page.text  # nothing from the network
    finally:
        out = _stop(proc)
    assert "s3cret-key" not in out


@pytest.mark.slow
@pytest.mark.browser
def test_dashboard_in_headless_chromium_follows_a_live_run(r, redis_url, run_name):
    need("browser", CHROMIUM is not None, "chromium is not installed (apt-get install chromium)")
    need("browser", installed("playwright"), "playwright is not installed (pip install playwright)")
    from playwright import sync_api

    run = SyntheticRun(r, run_name)
    for _ in range(6):
        run.step()
    run.leave_some_in_flight()
    unused = RunWarning("train_agent_unused", "solver", "runner.train_agents lists 'solver', but no call came",
                        time.time(), "runner:host-a:1")  # fmt: skip
    record_once(r, Keys(run_name), unused)
    port = free_port()
    proc = _start_dashboard(redis_url, run_name, port)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with sync_api.sync_playwright() as p:
            # Playwright gives the browser a fresh temporary profile itself (no --user-data-dir).
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            requests: list[str] = []
            page.on("request", lambda req: requests.append(req.url))
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_function("document.querySelector('#run').textContent !== '…'", timeout=10_000)

            def tile(name: str) -> str:
                return page.inner_text(f"[data-testid=tile-{name}] .value")

            assert tile("dispatched") == "28"
            assert tile("trained") == "18"
            assert tile("inflight") == "4"
            assert tile("balanced") == "yes"
            assert tile("version") == "v6"
            assert tile("staleness") == "2"
            assert tile("runners") == "2 / 3"
            assert page.inner_text("#run") == run_name
            assert page.locator("#ledger-legend [data-state='filtered:overlong']").inner_text().endswith("6")
            # the reward curve: a train line through 6 versions and 3 validation points
            assert page.locator("#reward-chart path.series-train").count() == 1
            assert page.locator("#reward-chart circle.pt-train").count() == 6
            assert page.locator("#reward-chart circle.pt-val").count() == 3
            assert page.locator("#metrics [data-metric=loss] path").count() == 1
            assert "node-b" in page.inner_text("#versions") and "2 behind" in page.inner_text("#versions")
            assert "tasks" in page.inner_text("#streams")
            assert page.inner_text("[data-testid=warnings]") == f"warning {unused.message}"  # the banner
            page.screenshot(path=str(ARTIFACTS / "dashboard-before.png"), full_page=True)

            # live: the run goes on and the page follows without a reload
            for _ in range(2):
                run.step()
            page.wait_for_function(
                "document.querySelector('[data-testid=tile-dispatched] .value').textContent === '36'",
                timeout=5_000,
            )
            assert tile("version") == "v8"
            assert page.locator("#reward-chart circle.pt-train").count() == 8
            assert "live" in page.inner_text("#live-text")
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            browser.close()
        assert all(url.startswith(f"http://127.0.0.1:{port}/") for url in requests), requests
    finally:
        _stop(proc)
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_dashboard_draws_each_roles_curve_and_versions(r, redis_url, run_name):
    """A [roles] run: the page draws one validation curve per role and a table of each role's
    version, the nodes serving it (and how far behind) and its last validation reward."""
    need("browser", CHROMIUM is not None, "chromium is not installed (apt-get install chromium)")
    need("browser", installed("playwright"), "playwright is not installed (pip install playwright)")
    from playwright import sync_api

    run = SyntheticRun(r, run_name)
    run.step()
    for role, means in {"villagers": [0.4, 0.6, 0.9], "wolves": [0.6, 0.7]}.items():
        for version, mean in enumerate(means):
            bus.publish(r, run.keys.rewards, schemas.RewardPoint(
                run=run_name, version=version, mode="val", mean=mean, count=16,
                group_id=f"round{version}", role=role))  # fmt: skip
        r.hset(
            run.keys.versions,
            mapping={f"trainer:{role}": len(means), f"inference:node-a:{role}": len(means) - 1},
        )
    port = free_port()
    proc = _start_dashboard(redis_url, run_name, port)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_function("document.querySelector('[data-testid=roles]') !== null", timeout=10_000)
            assert page.locator("#reward-chart path.series-role-villagers").count() == 1
            assert page.locator("#reward-chart circle.pt-role-villagers").count() == 3
            assert page.locator("#reward-chart circle.pt-role-wolves").count() == 2
            rows = page.inner_text("[data-testid=roles]")
            assert "villagers\tv3\tnode-a v2 (1 behind)\t0.9" in rows, rows
            assert "wolves\tv2\tnode-a v1 (1 behind)\t0.7" in rows, rows
            browser.close()
    finally:
        _stop(proc)
