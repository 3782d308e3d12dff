"""SIGTERM on each service under load loses nothing: a short real run (inference with a tiny
random model, trainer, scheduler, two runners with a tiny-LLM agent, all subprocesses on the
test Redis) in which a runner, the scheduler, the trainer and the inference node each get a
SIGTERM while work flows, must exit 0 within their grace period, and are restarted.

At the end (dataset finished, everything trained or filtered): the ledger balances, no attempt
is left pending/running/ok, no trajectory key was trained twice (trained.jsonl, the trainer's
durable log of checkpointed steps), every trained key is in the ledger as trained, and no
consumer group has an entry delivered but unacknowledged."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from runner_helpers import Procs, events, log_of, write_jsonl
from waiting import wait_for

from squall.inference.tiny import build_tiny_model
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SAMPLES = 22  # groups of 2: enough work to outlast the four stops and restarts
RUNNER_GRACE_S = 5.0
STOP_WITHIN_S = {"runner": RUNNER_GRACE_S + 10, "scheduler": 15, "trainer": 30, "inference": 30}
START_WITHIN_S = 60  # a cold start imports torch on a shared 2-core machine
UNSETTLED = ("pending", "running", "ok", "failed", "timeout")  # states someone still owes a move


def write_run_file(
    tmp: Path, redis_url: str, run: str, model: Path, dataset: Path, port: int, overrides: dict | None = None
) -> Path:
    """The run file of these tests; `overrides` ({section: {key: value}}) changes or adds settings."""
    sections: dict[str, dict] = {
        "run": {"name": run, "redis_url": redis_url, "dir": str(tmp / "run"), "log_level": "WARNING"},
        "model": {"path": str(model)},
        "scheduler": {"dataset": str(dataset), "group_size": 2, "max_inflight_groups": 3, "max_dispatch_lag": 4,
                      "max_attempts": 4, "shuffle": False},
        "runner": {"agent": "runner_agents:tiny_llm", "concurrency": 2, "inference_urls": [f"http://127.0.0.1:{port}"],
                   "lease_s": 4.0, "grace_s": RUNNER_GRACE_S, "heartbeat_s": 0.5, "upstream_retries": 7},
        "trainer": {"device": "cpu", "groups_per_step": 1, "lr": 1e-3, "max_sample_age": 1000, "group_wait_s": 120.0,
                    "overlong": "keep"},  # truncated: a random model rarely samples eos in 4 tokens
        "inference": {"port": port, "device": "cpu", "torch_threads": 1, "max_model_len": 512},
    }  # fmt: skip
    for section, values in (overrides or {}).items():
        sections.setdefault(section, {}).update(values)
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in values.items())
    path = tmp / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Run:
    """The five services of one run and what the test reads of their progress."""

    def __init__(self, r, procs: Procs, config: Path, port: int) -> None:
        self.r, self.procs, self.config, self.port = r, procs, config, port
        self.keys = Keys(procs.run)
        self.run_dir = config.parent / "run"
        self.live: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        service = name.split("-")[0]  # runner-1 -> runner
        proc = self.procs.start(service, "--config", str(self.config), SQUALL_TORCH_THREADS="1")
        self.live[name] = proc
        return proc

    def wait_started(self, name: str, within_s: float = START_WITHIN_S) -> None:
        proc = self.live[name]
        service = name.split("-")[0]
        if service == "inference":
            check = self._inference_up
        elif service == "scheduler":
            check = lambda: self._beat_of("scheduler") is not None  # noqa: E731
        else:
            check = lambda: self._beat_of(service, proc.pid) is not None  # noqa: E731
        wait_for(lambda: self._alive(name) and check(), within_s, f"{name} to start")

    def stop(self, name: str) -> float:
        """SIGTERM, and the exit status must be 0 within the service's grace period."""
        proc = self.live[name]
        service = name.split("-")[0]
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(STOP_WITHIN_S[service])
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not exit within {STOP_WITHIN_S[service]}s of SIGTERM") from None
        assert rc == 0, f"{name} exited {rc} on SIGTERM:\n{log_of(proc)[-3000:]}"
        return rc

    def _alive(self, name: str) -> bool:
        proc = self.live[name]
        assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{log_of(proc)[-3000:]}"
        return True

    def _inference_up(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _beat_of(self, service: str, pid: int | None = None) -> dict | None:
        for field, raw in self.r.hgetall(self.keys.heartbeats).items():
            if field.decode().startswith(f"{service}:"):
                beat = json.loads(raw)
                if beat.get("stopped"):
                    continue  # a process that exited cleanly, not one that started
                if pid is None or beat.get("pid") == pid:
                    return beat
        return None

    # --- progress ---------------------------------------------------------------
    def trained_lines(self) -> list[dict]:
        path = self.run_dir / "trained.jsonl"
        lines = []
        for raw in path.read_text().splitlines() if path.exists() else []:
            try:
                lines.append(json.loads(raw))
            except ValueError:
                pass  # a line being written
        return lines

    def trained_keys(self) -> list[str]:
        return [key for line in self.trained_lines() for key in line["keys"]]

    def counts(self) -> dict[str, int]:
        return Ledger(self.r, self.keys).counts()

    def flowing_after(self, trained: int) -> bool:
        """Training has gone past `trained` keys and attempts are running right now."""
        return len(self.trained_keys()) > trained and self.counts().get("running", 0) > 0

    def settled(self) -> bool:
        counts = self.counts()
        if any(counts.get(state, 0) for state in UNSETTLED):
            return False
        return all(info["pending"] == 0 and not info.get("lag") for info in self.group_infos())

    def group_infos(self) -> list[dict]:
        out = []
        for stream in (self.keys.tasks, self.keys.trajectories):
            if self.r.exists(stream):
                for info in self.r.xinfo_groups(stream):
                    out.append({"stream": stream, "group": info["name"], "pending": info["pending"],
                                "lag": info.get("lag")})  # fmt: skip
        return out


def test_sigterm_on_each_service_under_load_loses_nothing(tmp_path, r, redis_url, run_name):
    model = build_tiny_model(tmp_path / "model")
    rows = [{"id": f"s{i}", "question": f"What is {i} plus {i}?", "sleep": 0.3} for i in range(SAMPLES)]
    dataset = write_jsonl(tmp_path / "data.jsonl", rows)
    port = free_port()
    config = write_run_file(tmp_path, redis_url, run_name, model, dataset, port)
    procs = Procs(redis_url, run_name, tmp_path)
    run = Run(r, procs, config, port)
    try:
        for name in ("inference", "trainer", "runner-1", "runner-2"):
            run.start(name)
        for name in ("inference", "trainer", "runner-1", "runner-2"):
            run.wait_started(name)
        run.start("scheduler")

        # Each service in turn: wait until training has moved on and attempts are running,
        # SIGTERM it (exit 0 within its grace), start it again.
        for name in ("runner-1", "scheduler", "trainer", "inference"):
            mark = len(run.trained_keys())
            wait_for(lambda m=mark: run.flowing_after(m + 1), 60, f"work flowing before stopping {name}")
            started, at_keys = time.monotonic(), len(run.trained_keys())
            run.stop(name)
            stopped_s = time.monotonic() - started
            run.start(name)
            run.wait_started(name)
            print(f"{name}: SIGTERM at {at_keys} trained keys, exit 0 after {stopped_s:.1f}s, "
                  f"back after {time.monotonic() - started:.1f}s; ledger {run.counts()}")  # fmt: skip

        # The dataset runs to its end: the scheduler exits by itself, the trainer consumes the rest.
        scheduler = run.live["scheduler"]
        assert scheduler.wait(90) == 0, log_of(scheduler)[-3000:]
        assert [e.fields["reason"] for e in events(r, run_name, "finished")] == ["dataset_exhausted"]
        wait_for(run.settled, 60, "every attempt trained, filtered or retired and every entry acked")
        for name in ("trainer", "runner-1", "runner-2", "inference"):
            run.stop(name)  # the final stops are SIGTERMs too

        ledger = Ledger(r, Keys(run_name))
        counts = ledger.counts()
        print(f"end: ledger {counts}")
        assert ledger.balanced(), counts
        assert not [s for s in UNSETTLED if counts.get(s)], counts
        trained = run.trained_keys()
        assert len(trained) == len(set(trained)), "a trajectory was trained twice"
        assert trained and {ledger.state_of(key) for key in trained} == {"trained"}
        assert counts.get("trained", 0) == len(trained)  # nothing trained that the log lacks
        steps = [line["step"] for line in run.trained_lines()]
        assert steps == list(range(1, len(steps) + 1))  # every durable step logged once
        assert all(info["pending"] == 0 for info in run.group_infos()), run.group_infos()
        samples_done = {key.decode().split(":")[0] for key in r.hkeys(Keys(run_name).attempts)}
        assert len(samples_done) == SAMPLES  # every sample's group was dispatched
        assert len(events(r, run_name, "stopped")) >= 3  # scheduler, trainer (twice) at least
    finally:
        procs.stop_all()  # SIGTERM, then SIGKILL whatever is left: nothing outlives the test
        for proc in procs.procs:
            assert proc.poll() is not None
