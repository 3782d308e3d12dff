"""The sandbox on its own: real subprocesses, each escape refused or killed with a clear reason."""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlparse

import pytest

from squall.toolpool import sandbox
from squall.toolpool.sandbox import Limits, run_python

FAST = Limits(cpu_s=1, wall_s=3.0, memory_mb=256, processes=8, output_bytes=4096, file_mb=1)


def _sandbox_processes() -> list[int]:
    """Pids of live (not zombie) processes of a sandbox uid (as root): none may outlive a run."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid < sandbox.SANDBOX_UID_BASE:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state not in ("Z", "X"):  # dead, waiting for init to reap it
                found.append(int(entry))
    return found


def test_plain_code_runs_and_may_use_its_folder():
    result = run_python("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), sum(range(10)))", FAST)
    assert result.reason == "ok", result
    assert result.stdout == "hi 45\n" and result.exit_code == 0
    assert result.text() == "hi 45"


def test_a_python_error_is_a_result_with_the_last_traceback_line():
    result = run_python("1/0", FAST)
    assert result.reason == "error" and result.exit_code == 1
    assert "ZeroDivisionError: division by zero" in result.detail
    assert "ZeroDivisionError" in result.text()


def test_infinite_loop_is_killed_at_the_cpu_limit():
    started = time.monotonic()
    result = run_python("while True: pass", FAST)
    assert result.reason == "cpu_time", result
    assert "CPU-time limit of 1 s" in result.detail
    assert time.monotonic() - started < FAST.wall_s


def test_sleeping_code_is_killed_at_the_wall_clock():
    result = run_python("import time\ntime.sleep(60)", Limits(wall_s=1.0))
    assert result.reason == "wall_time" and result.exit_code is None
    assert 0.9 < result.duration_s < 3


def test_memory_bomb_is_refused():
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", FAST)
    assert result.reason == "memory", result
    assert "allocated" not in result.stdout and "256 MB" in result.detail


def test_fork_bomb_is_refused_and_leaves_no_process():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(code, FAST)
    assert result.reason in ("cpu_time", "wall_time", "processes"), result
    if os.geteuid() == 0:
        assert _sandbox_processes() == []


def test_fork_until_refused_names_the_process_limit():
    result = run_python("import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(5)\n", FAST)
    assert result.reason == "processes", result
    assert "process limit of 8" in result.detail


def test_writing_outside_the_work_folder_is_refused(tmp_path):
    os.chmod(tmp_path, 0o777)  # even a folder everyone may write to stays out of reach
    target = tmp_path / "escaped.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", FAST)
    assert result.reason == "error" and "PermissionError" in result.detail
    assert not target.exists()
    for path in ("/tmp/squall-escape", "/dev/shm/squall-escape"):
        assert run_python(f"open({path!r}, 'w').write('x')", FAST).reason == "error"
        assert not os.path.exists(path)


def test_big_files_are_refused():
    result = run_python("open('big', 'wb').write(b'0' * (4 << 20))", FAST)
    assert result.reason == "error" and "File too large" in result.detail


def test_worker_environment_and_secret_files_are_out_of_reach(tmp_path, monkeypatch):
    monkeypatch.setenv("SQUALL_RUN__REDIS_URL", "redis://squall-runner:hunter2@redis:6379/0")
    secret = tmp_path / "runner.env"
    secret.write_text("PASSWORD=hunter2\n")
    os.chmod(secret, 0o644)
    env = run_python("import os\nprint(sorted(os.environ))", FAST)
    assert env.reason == "ok" and "SQUALL" not in env.stdout and "hunter2" not in env.stdout
    assert set(eval(env.stdout)) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE"}
    for path in (str(secret), f"/proc/{os.getpid()}/environ", "/proc/1/environ", "/etc/shadow"):
        result = run_python(f"print(open({path!r}).read())", FAST)
        assert result.reason == "error" and "hunter2" not in result.stdout, (path, result)
        assert "PermissionError" in result.detail or "FileNotFoundError" in result.detail


def test_network_sockets_reach_nothing(redis_url):
    """TCP to the test's real Redis, UDP anywhere, and a Unix socket bind all fail."""
    port = urlparse(redis_url).port
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # reachable from here ...
    tcp = run_python(
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')", FAST
    )
    assert tcp.reason == "error" and "in" not in tcp.stdout, tcp  # ... not from the sandbox
    udp = run_python("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                     "s.sendto(b'x', ('1.1.1.1', 53))\nprint('sent')", FAST)  # fmt: skip
    assert udp.reason == "error" and "unreachable" in udp.detail.lower(), udp
    names = run_python("import socket\nprint(socket.if_nameindex())", FAST)
    assert names.reason == "ok" and "eth" not in names.stdout and "lo" in names.stdout


def test_printing_100_mb_is_cut_and_killed():
    started = time.monotonic()
    result = run_python("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\n", FAST)
    assert result.reason == "output_limit" and result.truncated
    assert len(result.stdout) + len(result.stderr) <= FAST.output_bytes
    assert time.monotonic() - started < 3


@pytest.mark.skipif(os.geteuid() != 0, reason="own uids need root")
def test_each_run_has_its_own_uid_and_no_privileges():
    result = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", FAST)
    uid, gid, groups = result.stdout.split(" ", 2)
    assert int(uid) >= sandbox.SANDBOX_UID_BASE and int(gid) == int(uid) and groups.strip() == "[]"
    assert "own_uid" in result.layers and "netns" in result.layers
