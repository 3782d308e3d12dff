"""The container images, built and run: a whole calculator run as separate podman containers.

`make images` builds the images first (base from Debian's packages, Redis, the CPU image; CI does
it in .ci/run); these tests then run deploy/containers/podman-run.sh exactly as
docs/containers.md gives it: Redis with AOF and ACL users, scheduler, inference, trainer and two
runners, each in its own container on one podman network. The run trains, the trainer container
is restarted mid-run (SIGTERM drain, then a fresh container) and no trajectory is lost or trained
twice, the ledger balances, and `squall status` on the host reads the run through Redis's
published port. A container given a Redis URL where no Redis answers exits, naming the URL.

The `containers` suite: skipped where podman or the images are missing, required in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis as redis_lib
from optional import need
from waiting import wait_for

from squall.shared.keys import Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import free_port

pytestmark = [pytest.mark.slow, pytest.mark.containers]
ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = ROOT / "deploy" / "containers"
SCRIPT = CONTAINERS / "podman-run.sh"
IMAGE = os.environ.get("SQUALL_IMAGE", "localhost/squall-cpu:latest")
REDIS_IMAGE = os.environ.get("SQUALL_REDIS_IMAGE", "localhost/squall-redis:latest")
RUN = "calc"


def podman_env() -> dict[str, str]:
    env = {**os.environ, "SQUALL_IMAGE": IMAGE, "SQUALL_REDIS_IMAGE": REDIS_IMAGE}
    # podman's defaults fail on hybrid-cgroup hosts such as CI's (see the file); a host with its
    # own settings keeps them.
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS / "podman-hybrid-cgroups.conf"))
    return env


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout
    )
    assert not check or done.returncode == 0, f"podman {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


@pytest.fixture(scope="module")
def images():
    need("containers", shutil.which("podman") is not None, "podman is missing (apt-get install podman runc)")
    for image in (IMAGE, REDIS_IMAGE):
        found = (
            subprocess.run(["podman", "image", "exists", image], env=podman_env(), timeout=60).returncode == 0
        )
        need("containers", found, f"image {image} is not built (make images)")


@pytest.fixture
def stack(tmp_path, images):
    """podman-run.sh's settings for one isolated run (its own prefix, network and volumes);
    everything is purged afterwards."""
    name = f"sqt-{uuid.uuid4().hex[:8]}"
    secrets = tmp_path / "secrets"
    subprocess.run([sys.executable, "-m", "squall.cli", "acl", "--run", RUN, "--out", str(secrets), "--host", "redis",
                    "--acl-mode", "644"], cwd=ROOT, check=True, capture_output=True, timeout=60)  # fmt: skip
    port = free_port()
    env = {**podman_env(), "SQUALL_NAME": name, "SQUALL_SECRETS": str(secrets), "SQUALL_APP": str(ROOT),
           "SQUALL_RUN_TOML": str(CONTAINERS / "calc.toml"), "SQUALL_RUNNERS": "2",
           "SQUALL_REDIS_PORT": str(port)}  # fmt: skip

    def script(*args: str, timeout: float = 600) -> str:
        done = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"podman-run.sh {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    try:
        yield name, secrets, port, script
    finally:
        subprocess.run([str(SCRIPT), "purge"], env=env, capture_output=True, timeout=600)


def host_url(secrets: Path, user: str, port: int) -> str:
    """The URL `squall acl` wrote for `user`, pointed at Redis's port published on the host."""
    line = next(
        x
        for x in (secrets / f"{user}.env").read_text().splitlines()
        if x.startswith("SQUALL_RUN__REDIS_URL=")
    )
    return line.split("=", 1)[1].replace("@redis:6379/", f"@127.0.0.1:{port}/")


def status(url: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "squall.cli", "status", "--run", RUN, "--redis-url", url, "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def trained_log(name: str) -> list[dict]:
    mount = podman("volume", "inspect", "-f", "{{.Mountpoint}}", f"{name}-runs").stdout.strip()
    path = Path(mount) / RUN / "trained.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


@pytest.mark.timeout(900)
def test_a_whole_run_in_containers_trains_survives_a_trainer_restart_and_balances(stack):
    name, secrets, port, script = stack
    script("python", "-m", "examples.calc.tasks", "--out", "/var/lib/squall/runs/calc-data", "--train", "48",
           "--val", "8", "--seed", "0")  # fmt: skip
    script("up")
    running = podman("ps", "--format", "{{.Names}}").stdout.split()
    expected = {"redis", "scheduler", "inference", "trainer", "runner-1", "runner-2"}
    assert {f"{name}-{s}" for s in expected} <= set(running), running
    # Credentials arrive as mounted files: no container's environment holds a password.
    passwords = [p.read_text().strip().split("@")[0].rsplit(":", 1)[1] for p in secrets.glob("*.url")]
    for container in (f"{name}-{s}" for s in expected):
        env = podman("inspect", "-f", "{{json .Config.Env}}", container).stdout
        assert "SQUALL_RUN__REDIS_URL_FILE=/run/secrets/redis_url" in env, (container, env)
        assert not any(pw in env for pw in passwords), f"{container}: a password is in its environment"
    monitor = host_url(secrets, "monitor", port)

    def trained_steps() -> int:
        return len(trained_log(name))

    try:
        wait_for(
            trained_steps, timeout_s=420, what="the first training step in the trainer container", interval=2
        )
        # Every container's health check passes while the run goes on (podman runs them on a
        # systemd timer; here, without systemd, on demand).
        for service in ("redis", "scheduler", "inference", "trainer", "runner-1"):
            health = podman("healthcheck", "run", f"{name}-{service}", check=False)
            assert health.returncode == 0, f"{service}: {health.stdout}{health.stderr}"
        # Mid-run: SIGTERM (the trainer finishes its step and exits 0), then a fresh container.
        out = script("restart", "trainer")
        assert f"{name}-trainer exited 0" in out, out
        wait_for(lambda: status(monitor)["finished"] and not status(monitor)["ledger"]["in_flight"],
                 timeout_s=420, what="the scheduler to finish the dataset with nothing in flight", interval=3)  # fmt: skip
        wait_for(lambda: len({k for line in trained_log(name) for k in line["keys"]}) >= trained_keys(secrets, port),
                 timeout_s=120, what="the trainer to log every trained trajectory", interval=2)  # fmt: skip
    except BaseException:
        for service in sorted(expected):
            print(
                f"--- {name}-{service}\n"
                + podman("logs", "--tail", "30", f"{name}-{service}", check=False).stderr
            )
        raise
    snapshot = status(monitor)
    ledger = snapshot["ledger"]
    assert ledger["balanced"] and ledger["dispatched"] == ledger["accounted"], ledger
    assert len(trained_log(name)) >= 1 and ledger["counts"].get("trained", 0) >= 1, ledger
    # Exactly once across the restart: each step logged once, no trajectory trained twice, and the
    # trained set is exactly what the ledger says was trained.
    log = trained_log(name)
    assert [line["step"] for line in log] == list(range(1, len(log) + 1)), [line["step"] for line in log]
    keys = [k for line in log for k in line["keys"]]
    assert len(keys) == len(set(keys)), "a trajectory was trained twice"
    ledger_of = Ledger(redis_lib.Redis.from_url(host_url(secrets, "admin", port)), Keys(RUN))
    assert {ledger_of.state_of(k) for k in keys} == {"trained"}
    assert len(keys) == ledger["counts"]["trained"], "a trained trajectory is missing from the trainer's log"
    # `squall status` as an operator types it, on the host, reading the containers' Redis.
    text = subprocess.run([sys.executable, "-m", "squall.cli", "status", "--run", RUN, "--redis-url", monitor],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert text.returncode == 0 and "conservation OK" in text.stdout, text.stdout + text.stderr
    assert f"trained={ledger['counts']['trained']}" in text.stdout, text.stdout
    stopped = script("down")
    for service in expected - {"redis"}:
        assert f"{name}-{service} exited 0" in stopped, stopped  # every service drained and exited 0


def trained_keys(secrets: Path, port: int) -> int:
    r = redis_lib.Redis.from_url(host_url(secrets, "admin", port))
    return Ledger(r, Keys(RUN)).counts().get("trained", 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("service", ["scheduler", "runner"])
def test_a_container_with_a_bad_redis_url_exits_naming_it(images, service):
    url = "redis://squall-x:secret@no-such-redis:6379/0"
    done = podman("run", "--rm", "-e", f"SQUALL_RUN__REDIS_URL={url}", "-e", "SQUALL_RUN__AUTOSTART_REDIS=false",
                  "-v", f"{CONTAINERS / 'calc.toml'}:/etc/squall/run.toml:ro",
                  "-v", f"{ROOT / 'examples'}:/opt/squall/app/examples:ro", "-e", "PYTHONPATH=/opt/squall/app",
                  IMAGE, service,
                  "--config", "/etc/squall/run.toml", timeout=240, check=False)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "redis://squall-x:***@no-such-redis:6379/0" in out, out  # the URL, its password masked
    assert "secret" not in out, out
