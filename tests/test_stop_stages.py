"""`squall up` stops its services in stages (local/procs.stop_in_stages): a stage is told only
after the one before has exited, and the whole stop ends by its deadline. Real processes."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from squall.local.procs import ServiceProcess, stop_in_stages
from squall.local.up import GRACE_S, STOP_STAGES, Up, stage_graces
from squall.shared.config import load_config

# A stand-in service: on SIGTERM it writes when it got it, takes `linger` seconds, exits 0;
# with linger < 0 it ignores SIGTERM.
SERVICE = """
import signal, sys, time
out, linger = sys.argv[1], float(sys.argv[2])
def term(*_):
    open(out, "w").write(repr(time.time()))
    if linger >= 0:
        time.sleep(linger)
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(out + ".up", "w").write("")
while True:
    time.sleep(0.05)
"""


def start(tmp_path, name: str, linger: float) -> ServiceProcess:
    proc = ServiceProcess(name, [], tmp_path / "logs")
    proc.log_dir.mkdir(parents=True, exist_ok=True)
    proc.process = subprocess.Popen([sys.executable, "-c", SERVICE, str(tmp_path / name), str(linger)])
    return proc


def wait_up(tmp_path, *names: str) -> None:
    end = time.monotonic() + 30
    while not all((tmp_path / f"{n}.up").exists() for n in names):
        assert time.monotonic() < end, "the stand-in services did not start"
        time.sleep(0.05)


def test_each_stage_is_told_after_the_one_before_exited(tmp_path):
    runner, trainer, inference = (
        start(tmp_path, "runner-0", 1.0),
        start(tmp_path, "trainer", 0.5),
        start(tmp_path, "inference-0", 0.0),
    )
    wait_up(tmp_path, "runner-0", "trainer", "inference-0")
    began = time.monotonic()
    codes = stop_in_stages([[runner], [trainer], [inference]], grace_s=10.0, deadline_s=30.0)
    assert codes == {"runner-0": 0, "trainer": 0, "inference-0": 0}
    told = {n: float((tmp_path / n).read_text()) for n in ("runner-0", "trainer", "inference-0")}
    assert told["trainer"] - told["runner-0"] >= 0.9  # after the runner's 1 s of draining
    assert told["inference-0"] - told["trainer"] >= 0.4
    assert time.monotonic() - began < 10


def test_a_stage_that_ignores_sigterm_is_killed_at_the_deadline(tmp_path):
    stuck, after = start(tmp_path, "runner-0", -1.0), start(tmp_path, "inference-0", 0.0)
    wait_up(tmp_path, "runner-0", "inference-0")
    began = time.monotonic()
    codes = stop_in_stages([[stuck], [after]], grace_s=1.0, deadline_s=5.0)
    assert codes["runner-0"] == -9 and codes["inference-0"] == 0
    assert time.monotonic() - began < 5


def test_each_stage_gets_its_own_grace(tmp_path):
    # The first stage lingers 2 s: killed under a 1 s grace, clean under 4 s.
    slow, quick = start(tmp_path, "runner-0", 2.0), start(tmp_path, "trainer", 0.0)
    wait_up(tmp_path, "runner-0", "trainer")
    codes = stop_in_stages([[slow], [quick]], grace_s=[4.0, 1.0], deadline_s=10.0)
    assert codes == {"runner-0": 0, "trainer": 0}
    slow = start(tmp_path, "runner-1", 2.0)
    wait_up(tmp_path, "runner-1")
    assert stop_in_stages([[slow]], grace_s=[1.0], deadline_s=10.0) == {"runner-1": -9}


def test_runners_stage_outlasts_the_runners_own_drain():
    # A runner drains for runner.grace_s, then hands back: killing it at that moment loses the
    # hand-back (a time-limited real-model run printed `unclean exits: {'runner-0': -9}`).
    graces = dict(zip(STOP_STAGES, stage_graces(30.0), strict=True))
    assert graces[("runner", "worker")] >= 30.0 + 10
    assert all(g == GRACE_S for names, g in graces.items() if "runner" not in names)
    assert stage_graces(0.0)[0] == GRACE_S


def test_up_shutdown_stops_its_services_in_order_and_reports_unclean_ones(tmp_path, capsys):
    config = load_config(None, env={"SQUALL_RUN__NAME": "stop-test", "SQUALL_RUN__DIR": str(tmp_path / "run"),
                                    "SQUALL_RUNNER__GRACE_S": "1"})  # fmt: skip
    up = Up(config, argparse.Namespace(config=None))
    crashed = ServiceProcess("worker-0", [], tmp_path / "logs")
    crashed.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    up.processes = [start(tmp_path, "inference-0", 0.0), start(tmp_path, "trainer", 0.3),
                    start(tmp_path, "runner-0", 0.5), start(tmp_path, "scheduler", 0.2), crashed]  # fmt: skip
    wait_up(tmp_path, "inference-0", "trainer", "runner-0", "scheduler")
    crashed.process.wait(timeout=30)
    up.reason = "time limit"
    up._shutdown()
    told = {n: float((tmp_path / n).read_text()) for n in ("runner-0", "scheduler", "trainer", "inference-0")}
    assert told["runner-0"] + 0.4 < told["scheduler"] < told["trainer"] < told["inference-0"]
    out = capsys.readouterr().out
    assert "stopped 5 services (time limit)" in out and "unclean exits: {'worker-0': 3}" in out
