"""The sandbox for model-written Python: one fresh, confined process per job.

`run_python(code, limits)` writes the code to `main.py` in an empty temporary folder and runs
it with the system's Python interpreter (`-I -S -B`: no site-packages, no PYTHON* variables,
no user folder, no .pyc files) under these layers, each set up between fork and exec:

| layer | how | stops |
|---|---|---|
| resource limits | setrlimit: CPU seconds, address space, file size, open files, processes, no core | busy loops, memory bombs, huge files, fork bombs |
| wall clock | the parent kills the process group at `wall_s` | sleeping or blocked code |
| output cap | the parent reads at most `output_bytes`, then kills | printing 100 MB |
| own user id | as root: a uid of its own (`SANDBOX_UID_BASE + pid`), no groups; the process limit then counts this job's processes only, and the worker's files and /proc entries are out of reach | reading the worker's memory, env or files through /proc; signalling it |
| no network | a new, empty network namespace (only a down loopback): `unshare(CLONE_NEWNET)`, as non-root inside a new user namespace | any socket traffic, including to Redis on localhost |
| Landlock | reads only beneath the Python installation, /usr, /lib*, /bin; writes only in the work folder; TCP bind/connect refused; no signals or abstract sockets outside | reading deploy secrets or the repo, writing outside the folder |
| clean start | env = PATH, HOME/TMPDIR = the work folder, LANG; stdin empty; every other fd closed; PDEATHSIG | inherited secrets; orphans when the worker dies |

After the run every process left (anything that forked and changed session) is killed: as
root by a helper that takes the job's uid and kills all of its processes. The folder is
deleted. docs/toolpool.md lists what this does not protect against.
"""

from __future__ import annotations

import ctypes
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from squall.shared.supervision import die_with_parent
from squall.toolpool import landlock

SANDBOX_UID_BASE = 1_000_000  # as root, job uids are 1_000_000 + child pid: no real account owns them
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
READ_CHUNK = 65536  # bytes per read of the child's pipes
EXIT_POLL_S = 0.05  # with no output for this long, check whether the main process has exited
STDERR_TAIL_CHARS = 2000  # what of stderr the model sees


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    cpu_s: int = 5  # CPU seconds (SIGXCPU at the soft limit, SIGKILL one second later)
    memory_mb: int = 512  # address space; Python raises MemoryError beyond it
    file_mb: int = 8  # largest file the code may write
    processes: int = 16  # processes (and threads) at once, the first one included
    open_files: int = 64  # file descriptors
    wall_s: float = 10.0  # wall-clock time until the whole process group is killed
    output_bytes: int = 65536  # stdout + stderr kept; more kills the run


@dataclass
class SandboxResult:
    """What happened to one run; `text()` is what a model is shown."""

    reason: str  # ok | error | cpu_time | memory | processes | wall_time | output_limit | signal
    detail: str  # one sentence for people and models
    exit_code: int | None  # the process's exit status; negative = signal; None = killed by us
    stdout: str
    stderr: str
    duration_s: float  # wall time from spawn to reaped
    cpu_s: float  # user + system CPU seconds of the main process
    truncated: bool  # output went past limits.output_bytes
    layers: list[str] = field(default_factory=list)  # confinement layers applied

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.reason != "ok":
            if self.stderr:
                parts.append(self.stderr[-STDERR_TAIL_CHARS:].rstrip("\n"))
            parts.append(f"[sandbox: {self.detail}]")
        return "\n".join(parts)


class _Confine:
    """Runs in the child between fork and exec: every layer but the parent-side ones."""

    def __init__(self, workdir: str, limits: Limits, read_paths: list[str], nproc_base: int) -> None:
        self.workdir, self.limits, self.read_paths, self.nproc_base = workdir, limits, read_paths, nproc_base
        self.as_root = os.geteuid() == 0

    def __call__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        lim = self.limits
        set_limit = resource.setrlimit
        set_limit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
        set_limit(resource.RLIMIT_AS, (lim.memory_mb << 20,) * 2)
        set_limit(resource.RLIMIT_FSIZE, (lim.file_mb << 20,) * 2)
        set_limit(resource.RLIMIT_NOFILE, (lim.open_files,) * 2)
        set_limit(resource.RLIMIT_CORE, (0, 0))
        set_limit(resource.RLIMIT_NPROC, (self.nproc_base + lim.processes,) * 2)
        flags = CLONE_NEWNET if self.as_root else CLONE_NEWUSER | CLONE_NEWNET
        if libc.unshare(flags) != 0:
            raise OSError(ctypes.get_errno(), "unshare(network namespace) failed")
        if self.as_root:
            uid = SANDBOX_UID_BASE + os.getpid()
            os.chown(self.workdir, uid, uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        # After the uid change: changing credentials clears the parent-death signal.
        die_with_parent(signal.SIGKILL)
        landlock.restrict(self.read_paths, [self.workdir, os.devnull])


def _reachable_by_others(path: str) -> bool:
    """Every folder on the way is searchable, and the file readable and executable, by any user."""
    if not os.access(path, os.X_OK) or (os.stat(path).st_mode & 0o005) != 0o005:
        return False
    folder = os.path.dirname(path)
    while folder not in ("/", ""):
        if not os.stat(folder).st_mode & 0o001:
            return False
        folder = os.path.dirname(folder)
    return True


def interpreter(configured: str = "") -> str:
    """The Python binary that runs sandboxed code, resolved past links (a venv stays out of reach).

    `configured` if given; else the worker's own interpreter, unless the worker runs as root
    and a job's own uid could not reach it (e.g. pyenv under /root): then the system's python3.
    """
    if configured:
        return os.path.realpath(configured)
    own = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or _reachable_by_others(own):
        return own
    system = os.path.realpath(shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3")
    return system


def read_paths(python: str) -> list[str]:
    """What the sandboxed interpreter may read: its installation and the system's libraries."""
    bin_dir = os.path.dirname(python)
    prefix = os.path.dirname(bin_dir)
    paths = {
        python,
        bin_dir,
        os.path.join(prefix, "lib"),
        "/usr/lib",
        "/usr/lib64",
        "/lib",
        "/lib64",
        "/usr/local/lib",
        "/etc/ld.so.cache",
        "/dev/urandom",
        os.devnull,
    }
    return sorted(p for p in paths if os.path.exists(p))


def layers() -> list[str]:
    """The confinement layers this machine gives a sandboxed run (for logs and docs)."""
    found = [
        "rlimits",
        "wall_clock",
        "output_cap",
        "clean_env",
        "netns" + ("" if os.geteuid() == 0 else "+userns"),
    ]
    if os.geteuid() == 0:
        found.append("own_uid")
    abi = landlock.abi_version()
    if abi:
        found.append(f"landlock_abi{abi}")
    return found


def _processes_of(uid: int) -> int:
    """Processes (threads included, as RLIMIT_NPROC counts them) of `uid` now."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                st = os.stat(f"/proc/{entry}")
            except OSError:
                continue
            if st.st_uid == uid:
                try:
                    count += len(os.listdir(f"/proc/{entry}/task"))
                except OSError:
                    count += 1
    return count


def _kill_uid(uid: int) -> None:
    """Kill every process of `uid` (as root): a helper takes the uid and kills all it may signal."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def run_python(code: str, limits: Limits = Limits(), python: str = "") -> SandboxResult:  # noqa: B008
    """Run `code` as described in the module docstring; never raises for what the code does.

    `python`: the interpreter (see `interpreter`); `limits` is frozen, so the default is shared safely.
    """
    exe = interpreter(python)
    workdir = tempfile.mkdtemp(prefix="squall-sandbox-")
    os.chmod(workdir, 0o700)
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        as_root = os.geteuid() == 0
        confine = _Confine(
            workdir, limits, read_paths(exe) + [workdir], 0 if as_root else _processes_of(os.getuid())
        )
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        started = time.monotonic()
        proc = subprocess.Popen(
            [exe, "-I", "-S", "-B", "main.py"],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
            preexec_fn=confine,
        )
        try:
            out, err, killed_for, truncated, reaped = _collect(proc, limits, started)
        finally:
            _kill_group(proc.pid)
        _, status, usage = reaped or os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if as_root:
            _kill_uid(SANDBOX_UID_BASE + proc.pid)
        duration = time.monotonic() - started
        cpu = usage.ru_utime + usage.ru_stime
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        reason, detail = _classify(proc.returncode, killed_for, stderr, cpu, limits)
        return SandboxResult(
            reason,
            detail,
            None if killed_for else proc.returncode,
            stdout,
            stderr,
            round(duration, 4),
            round(cpu, 4),
            truncated,
            layers(),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(
    proc: subprocess.Popen, limits: Limits, started: float
) -> tuple[bytes, bytes, str, bool, tuple | None]:
    """Read stdout and stderr until the main process has exited and its output is drained (what
    it left running is killed, not waited for), or the output cap, or the wall clock.

    Returns stdout, stderr, why we killed it ("" if we did not), truncated, and wait4's
    (pid, status, rusage) if the process was reaped here.
    """
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    killed_for, truncated, total, reaped = "", False, 0, None
    deadline = started + limits.wall_s
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_for = "wall_time"
                break
            ready = selector.select(timeout=min(remaining, EXIT_POLL_S))
            for key, _ in ready:
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                room = limits.output_bytes - total
                buffers[key.fd] += chunk[:room]
                total += min(len(chunk), room)
                if len(chunk) > room:
                    killed_for, truncated = "output_limit", True
                    break
            if killed_for:
                break
            if not ready and reaped is None:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:  # exited; its pipes stay open only while something it started lives on
                    reaped = (pid, status, usage)
                    _kill_group(proc.pid)
    finally:
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    if killed_for:
        _kill_group(proc.pid)
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), killed_for, truncated, reaped


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(code: int, killed_for: str, stderr: str, cpu: float, limits: Limits) -> tuple[str, str]:
    if killed_for == "wall_time":
        return "wall_time", f"killed: ran longer than the wall-clock limit of {limits.wall_s:g} s"
    if killed_for == "output_limit":
        return "output_limit", f"killed: printed more than the output limit of {limits.output_bytes} bytes"
    # SIGXCPU comes only from RLIMIT_CPU (rusage may read a tick under the limit); the hard
    # limit's SIGKILL a second later is told apart from others by the CPU time used.
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= limits.cpu_s - 0.5):
        return "cpu_time", f"killed: used more than the CPU-time limit of {limits.cpu_s} s"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if "BlockingIOError" in last and "Resource temporarily unavailable" in last:
        return "processes", f"refused: started more than the process limit of {limits.processes}"
    if "MemoryError" in last:
        return "memory", f"refused: allocated more than the memory limit of {limits.memory_mb} MB"
    if code < 0:
        return "signal", f"killed by signal {signal.Signals(-code).name}"
    if code != 0:
        return "error", f"exit status {code}" + (f": {last}" if last else "")
    return "ok", "exit status 0"
