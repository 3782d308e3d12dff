"""deploy/: the systemd units pass `systemd-analyze verify` (and `security --offline`), and the
compose file validates against the Compose Specification schema.

No engine runs here: `systemd-analyze verify` loads each unit with systemd's own parser in a
throw-away root (this machine's unit files copied in, the ExecStart binaries stubbed), which
is what systemd does at daemon-reload; the compose file is checked with check-jsonschema's
vendored compose-spec schema (`docker compose config` needs the compose plugin, absent on
Debian's docker.io) and structurally (what compose would accept but we would regret)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from optional import installed, need

from squall.cli import COMMANDS
from squall.monitor import acl
from squall.shared.config import RunnerSection

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "deploy" / "systemd"
CONTAINERS = ROOT / "deploy" / "containers"
SERVICE_UNITS = {
    "squall-scheduler.service": "squall-scheduler.service",
    "squall-runner@.service": "squall-runner@3.service",
    "squall-toolpool@.service": "squall-toolpool@1.service",
    "squall-trainer.service": "squall-trainer.service",
    "squall-inference@.service": "squall-inference@8000.service",
    "squall-dashboard.service": "squall-dashboard.service",
    "squall-redis.service": "squall-redis.service",
}
SYSTEM_UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
MAX_EXPOSURE = 3.0  # systemd-analyze security: 0 (locked down) .. 10 (exposed)


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections -> (key, value) pairs in order; systemd allows repeated keys."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", text)
    assert match, f"unexpected duration {text!r}"
    return float(match.group(1)) * (60 if match.group(2) == "min" else 1)


# --- systemd --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unit_root(tmp_path_factory):
    """A root with this machine's unit files, ours in /etc/systemd/system, binaries stubbed."""
    need(
        "systemd",
        shutil.which("systemd-analyze") is not None,
        "systemd-analyze is missing (apt-get install systemd)",
    )
    system_units = next((d for d in SYSTEM_UNIT_DIRS if (d / "sysinit.target").exists()), None)
    need(
        "systemd",
        system_units is not None,
        "no system unit files to verify against (apt-get install systemd)",
    )
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in [*SYSTEMD.glob("*.service"), *SYSTEMD.glob("*.target")]:
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    for binary in ("opt/squall/venv/bin/squall", "usr/bin/redis-server"):
        stub = root / binary
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return root


def _verify(root: Path, *units: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *units], capture_output=True, text=True, timeout=60
    )


def test_units_pass_systemd_analyze_verify(unit_root):
    result = _verify(unit_root, *SERVICE_UNITS.values(), "squall.target")
    # verify exits 0 on mere warnings (an unknown key, a bad value it ignores): any output fails
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), result.stderr


def test_verify_catches_a_broken_unit(unit_root):
    broken = unit_root / "etc/systemd/system/squall-broken.service"
    text = (SYSTEMD / "squall-scheduler.service").read_text()
    broken.write_text(text.replace("Restart=on-failure", "Restart=sometimes\nProtectSytem=strict"))
    try:
        result = _verify(unit_root, "squall-broken.service")
    finally:
        broken.unlink()
    assert "restart specifier" in result.stderr and "ProtectSytem" in result.stderr


@pytest.mark.parametrize("instance", SERVICE_UNITS.values())
def test_units_are_hardened_per_systemd_analyze_security(unit_root, instance):
    result = subprocess.run(
        ["systemd-analyze", "security", f"--root={unit_root}", "--offline=yes", instance],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout + result.stderr)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


@pytest.mark.parametrize("name", SERVICE_UNITS)
def test_unit_policy(name):
    unit = parse_unit(SYSTEMD / name)
    service = dict(unit["Service"])
    assert service["User"] == "squall" and service["Group"] == "squall"
    for key, expected in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                          "PrivateTmp": "yes", "Restart": "on-failure", "KillSignal": "SIGTERM"}.items():  # fmt: skip
        assert service.get(key) == expected, f"{name}: {key}={service.get(key)}"
    assert "/var/lib/squall" in values(unit, "Service", "ReadWritePaths")
    assert values(unit, "Install", "WantedBy") == ["squall.target"]
    if name == "squall-redis.service":
        return
    assert values(unit, "Service", "EnvironmentFile")[0] == "/etc/squall/squall.env"
    command = service["ExecStart"].split()
    assert command[0] == "/opt/squall/venv/bin/squall" and command[1] in COMMANDS, command
    own_env = {"scheduler": "scheduler", "runner": "runner", "trainer": "trainer", "inference": "inference",
               "dashboard": "monitor", "worker": "worker", "toolpool": "worker"}[command[1]]  # fmt: skip
    assert own_env in acl.SERVICES
    assert f"-/etc/squall/{own_env}.env" in values(unit, "Service", "EnvironmentFile")
    if command[1] == "runner":  # SIGKILL only after the runner's grace period has passed
        assert _seconds(service["TimeoutStopSec"]) > RunnerSection().grace_s + 30
        assert "%i" in service["SyslogIdentifier"]


# --- containers -----------------------------------------------------------------------------


def _compose() -> dict:
    return yaml.safe_load((CONTAINERS / "compose.yaml").read_text())


def test_compose_file_matches_the_compose_spec_schema(tmp_path):
    need(
        "deploy",
        installed("check_jsonschema"),
        "pip install check-jsonschema (vendors the compose-spec schema)",
    )
    checker = shutil.which("check-jsonschema") or str(
        Path(__import__("sys").executable).parent / "check-jsonschema"
    )
    ok = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", str(CONTAINERS / "compose.yaml")],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        (CONTAINERS / "compose.yaml").read_text().replace("    stop_grace_period: 90s", "    comand: x")
    )
    bad = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", str(broken)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "comand" in bad.stdout + bad.stderr


def test_compose_brings_up_redis_with_aof_and_acls_and_every_service():
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"redis", "scheduler", "runner", "trainer", "inference", "dashboard", "worker"}
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    acl_path = redis_cmd[redis_cmd.index("--aclfile") + 1]
    assert any(v.endswith(f"{acl.ACL_FILE}:{acl_path}:ro") for v in services["redis"]["volumes"])
    assert any(v.startswith("redis-data:/data") for v in services["redis"]["volumes"])
    assert "healthcheck" in services["redis"]
    for name, service in services.items():
        if name == "redis":
            continue
        assert service["command"][0] in COMMANDS, name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert service["stop_signal"] == "SIGTERM" and service["restart"] == "on-failure", name
        assert "no-new-privileges:true" in service["security_opt"] and service["cap_drop"] == ["ALL"], name
        # Credentials as a mounted file (a compose secret `squall acl` wrote), none in the environment.
        assert not any(f.startswith("./secrets/") for f in service.get("env_file", [])), name
        assert service["environment"]["SQUALL_RUN__REDIS_URL_FILE"] == "/run/secrets/redis_url", name
        (secret,) = service["secrets"]
        assert secret["target"] == "redis_url", name
        assert compose["secrets"][secret["source"]]["file"] == f"./secrets/{secret['source']}.url", name
        assert secret["source"] in acl.SERVICES, name
        assert "./run.toml:/etc/squall/run.toml:ro" in service["volumes"], name
    runner = services["runner"]
    assert "container_name" not in runner and "ports" not in runner  # so --scale runner=N works
    assert _seconds(runner["stop_grace_period"]) > RunnerSection().grace_s
    for name in ("trainer", "inference"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    # trainer and inference see the weight files at the same path
    assert "runs:/var/lib/squall/runs" in services["trainer"]["volumes"]
    assert "runs:/var/lib/squall/runs" in services["inference"]["volumes"]


def test_containerfiles_build_what_compose_expects():
    services = _compose()["services"]
    built = {s["build"]["dockerfile"] for s in services.values() if "build" in s}
    assert built == {"deploy/containers/Containerfile.cpu", "deploy/containers/Containerfile.gpu"}
    cpu = (CONTAINERS / "Containerfile.cpu").read_text()
    gpu = (CONTAINERS / "Containerfile.gpu").read_text()
    # The CPU image's base is an argument (a local base where no registry answers), the public
    # slim image by default; torch is its CPU build. The GPU image keeps verl and vLLM in venvs
    # of their own, as the Makefile does.
    assert re.search(r"^ARG BASE=python:3\.11-slim-bookworm$", cpu, flags=re.M) and "FROM ${BASE}" in cpu
    assert re.search(r"^ARG CUDA_BASE=nvidia/cuda:\S+-runtime-", gpu, flags=re.M)
    assert "/opt/squall/venv-verl/bin/pip install" in gpu and "/opt/squall/venv-vllm/bin/pip install" in gpu
    for text in (cpu, gpu):
        assert "USER squall" in text and 'ENTRYPOINT ["squall"]' in text
        for copied in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M):
            assert (ROOT / copied).exists(), copied  # every COPY source is in the repository
