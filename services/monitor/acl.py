"""`squall acl`: a Redis ACL file with one least-privilege user per service.

Each service user gets exactly the commands it calls, on exactly the keys of one run
(`squall:{run}:<name>`, names from shared/keys.py). Permissions are written as Redis 7
*selectors*: a command is allowed when one grant (the root one or a `(...)` selector) names
both the command and every key it touches, so "XADD on trajectories" does not leak into
"XADD on tasks" although the runner holds both XADD and some right on `tasks`.

What Redis ACLs can express here, and what they cannot (docs/operating.md has the matrix):
- can: which commands, on which key names, read (`%R~`) or read-write (`~`); keyless
  commands (PING, SCRIPT LOAD, MULTI) per user; no pub/sub channels; `default` disabled.
  Lua scripts run as the calling user, so every command a script calls is checked too.
- cannot: a consumer-group or consumer name (a user allowed XREADGROUP on a stream may
  name any group of it), a hash field (any user that may HSET heartbeats may write any
  field), XADD's MAXLEN/MINID arguments (an XADD may trim), message contents (a runner
  can forge a reward), or rates and sizes (a loaded Lua script may loop until busy-timeout).

Passwords are generated (or given with --password SERVICE=SECRET) and written only to
the per-service env files (mode 0600); the ACL file holds their SHA-256 (`#<hex>`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from squall.shared.keys import Keys

SERVICES = ("scheduler", "runner", "trainer", "inference", "monitor", "worker", "optimizer")
ADMIN_USER = "admin"  # full rights, for operators' redis-cli and migrations; never given to a service
PASSWORD_BYTES = 32  # 256 random bits per generated password
ACL_FILE = "users.acl"

# Keyless commands every service user needs: connection setup as redis-py does it (AUTH is
# always allowed; HELLO for RESP3, SELECT for /db in the URL; CLIENT SETINFO is left out
# because Redis 7.0 does not know it and rejects the whole file: redis-py ignores its refusal),
# MULTI/EXEC for transactional pipelines, and loading the Lua scripts of shared/bus.py and
# shared/ledger.py (redis-py's Script does EVALSHA, then SCRIPT LOAD on NOSCRIPT;
# pipelines check with SCRIPT EXISTS first).
CONNECTION = (
    "ping",
    "echo",
    "hello",
    "select",
    "reset",
    "quit",
    "client|setname",
    "client|getname",
    "client|id",
)
WRITER_KEYLESS = (
    "multi",
    "exec",
    "discard",
    "unwatch",
    "script|load",
    "script|exists",
)  # not for the read-only monitor

# Command sets, named by what they are for.
STREAM_READ = ("xlen", "xrange", "xrevrange", "xread", "xinfo|stream")
STREAM_GROUP_INFO = ("xinfo|groups", "xinfo|consumers", "xpending")
STREAM_CONSUME = ("xreadgroup", "xack", "xclaim", "xautoclaim", "xpending", "xgroup|create")
STREAM_APPEND = ("xadd",)
STREAM_TRIM = ("xtrim",)
HASH_READ = ("hget", "hmget", "hgetall", "hlen", "hkeys", "hexists", "hscan")
HASH_WRITE = ("hset", "hdel", "hincrby")
# shared/ledger.py's transition script: EVALSHA with KEYS = attempts, ledger; it calls
# HGET, HSET and HINCRBY on them. shared/bus.py's renew script: EVALSHA with KEYS = the
# stream; it calls XPENDING and XCLAIM on it.
SCRIPT = ("evalsha",)
# Read-only keyspace look-ups a monitor may make on the run's keys.
KEY_INFO = ("exists", "type")

# rq (the tool pool, services/toolpool), found by recording a pool's and its clients' traffic
# (redis-cli MONITOR): jobs are hashes, queues lists, registries sorted sets, results streams,
# worker sets; WATCH/MULTI for status changes; EVALSHA for its locking scripts. rq's keys are
# `rq:*` for every run alike (job ids are global): a user that may use rq may touch any rq job.
RQ_KEYS = "rq:*"
RQ_READ = (
    "hget",
    "hmget",
    "hgetall",
    "hexists",
    "hlen",
    "exists",
    "type",
    "ttl",
    "pttl",
    "smembers",
    "scard",
    "sismember",
    "zcard",
    "zcount",
    "zrange",
    "zrangebyscore",
    "zscore",
    "lrange",
    "llen",
    "lindex",
    "lpos",
    "xread",
    "xrange",
    "xrevrange",
    "xlen",
    "get",
)
RQ_WRITE = (
    "hset",
    "hdel",
    "hincrby",
    "hincrbyfloat",
    "set",
    "del",
    "unlink",
    "expire",
    "pexpire",
    "persist",
    "sadd",
    "srem",
    "zadd",
    "zrem",
    "zremrangebyscore",
    "zpopmin",
    "rpush",
    "lpush",
    "lpop",
    "blpop",
    "lrem",
    "lmove",
    "blmove",
    "xadd",
    "xtrim",
    "watch",
    "unwatch",
    "evalsha",
)
# + channel rq:pubsub:* (stop/kill commands to workers). No INFO: the pool tells rq the server
# version from HELLO (toolpool/queues.py), as INFO is refused to every service user.
RQ_WORKER_KEYLESS = ("client|info", "subscribe", "unsubscribe")


@dataclass(frozen=True)
class Grant:
    """Some commands on some keys of the run: one ACL selector."""

    commands: tuple[str, ...]
    keys: tuple[str, ...]  # attribute names of shared.keys.Keys (tasks, ledger, ...)
    write: bool  # False: read-only key access (%R~), even for a command that would write


def _unique(items: tuple[str, ...]) -> list[str]:
    return list(dict.fromkeys(items))


# What every service writes: a heartbeat field, lifecycle events, dead letters; and the
# run config it may read.
_COMMON_GRANTS = (
    Grant(HASH_WRITE[:2] + ("hget",), ("heartbeats",), write=True),
    Grant(STREAM_APPEND, ("events", "deadletter"), write=True),
    Grant(HASH_READ, ("config",), write=False),
)
_LEDGER = Grant(
    SCRIPT + ("hget", "hset", "hincrby", "hgetall", "hlen", "hscan"), ("attempts", "ledger"), write=True
)

# Publishing a resource version (shared/resources.py): WATCH the current pins, then one MULTI of
# HSETs and the stream's XADD.
_RESOURCE_PUBLISH = (
    Grant(HASH_READ + ("hset", "watch"), ("resources_current", "resources_versions"), write=True),
    Grant(STREAM_APPEND, ("resources",), write=True),
)

# The matrix. Each tuple lists the grants of one service user besides the common ones.
MATRIX: dict[str, tuple[Grant, ...]] = {
    # Owns the run: dispatches tasks, consumes its group of trajectories, keeps the ledger,
    # the groups and its cursor, writes the reward curve, reads control and versions.
    "scheduler": (
        Grant(
            STREAM_APPEND + STREAM_READ + STREAM_GROUP_INFO + STREAM_CONSUME + STREAM_TRIM + ("xdel",),
            ("tasks",),
            write=True,
        ),
        Grant(STREAM_CONSUME + STREAM_READ + STREAM_GROUP_INFO + STREAM_TRIM, ("trajectories",), write=True),
        Grant(
            STREAM_APPEND + STREAM_READ + STREAM_TRIM,
            ("rewards", "control", "events", "deadletter"),
            write=True,
        ),
        Grant(STREAM_READ, ("weights", "weights_applied", "metrics"), write=False),
        _LEDGER,
        Grant(
            HASH_READ + HASH_WRITE + ("del",), ("groups", "scheduler_state", "config", "infra"), write=True
        ),
        # The end-of-data handshake (shared/dataend.py): announced once, cleared on a resume.
        Grant(HASH_READ + HASH_WRITE + ("hsetnx", "del"), ("data_end",), write=True),
        Grant(HASH_READ, ("versions", "heartbeats"), write=False),
        *_RESOURCE_PUBLISH,  # the run file's [resources] as version 1 (shared/resources.py)
    ),
    # Stateless worker: consumes `tasks` in group `runners` (read, ack, renew by script,
    # reclaim lapsed leases), appends trajectories, and moves its attempts pending -> running
    # -> outcome in the ledger (runner.py's finish script: XPENDING/XACK on tasks, XADD on
    # trajectories, HGET/HSET/HINCRBY on attempts and ledger, one EVALSHA over all four keys).
    # It never reads trajectories, never adds tasks, never sees the scheduler's groups.
    "runner": (
        Grant(STREAM_CONSUME + SCRIPT, ("tasks",), write=True),
        Grant(STREAM_APPEND, ("trajectories",), write=True),
        _LEDGER,
        Grant(SCRIPT, ("tasks", "trajectories", "attempts", "ledger"), write=True),
        Grant(HASH_READ, ("versions",), write=False),
        Grant(STREAM_READ, ("control",), write=False),
        Grant(("hsetnx",), ("warnings",), write=True),  # a train_agents entry never called (runwarnings)
        Grant(("hget",), ("resources_versions",), write=False),  # the versions its tasks pinned
    ),
    # Consumes `trajectories` in group `trainer`, moves attempts to trained/filtered,
    # publishes weights and metrics and its own version.
    "trainer": (
        Grant(
            STREAM_CONSUME + STREAM_READ + STREAM_GROUP_INFO + STREAM_TRIM + SCRIPT,
            ("trajectories",),
            write=True,
        ),
        Grant(STREAM_APPEND + STREAM_READ, ("weights", "metrics"), write=True),
        Grant(STREAM_READ, ("weights_applied",), write=False),
        Grant(("hset", "hget", "hgetall"), ("versions",), write=True),
        Grant(("hset", "hgetall"), ("data_end",), write=True),  # the end-of-data answer
        Grant(("hset", "hget"), ("durable",), write=True),  # its last settled commit (shared.durability)
        _LEDGER,
    ),
    # The prompt optimiser (services/optimizer): its own group on `trajectories`, evaluation
    # tasks and their ledger moves, resource versions, its checkpoint and call records.
    "optimizer": (
        Grant(STREAM_CONSUME + STREAM_READ + STREAM_GROUP_INFO, ("trajectories",), write=True),
        Grant(STREAM_APPEND, ("tasks", "rewards", "optimizer_calls"), write=True),
        _LEDGER,
        *_RESOURCE_PUBLISH,
        Grant(HASH_READ + HASH_WRITE, ("optimizer_state",), write=True),
        Grant(HASH_READ, ("versions",), write=False),
    ),
    # Follows `weights` (no group: every node sees every entry), acknowledges versions.
    "inference": (
        Grant(STREAM_READ, ("weights",), write=False),
        Grant(STREAM_APPEND, ("weights_applied",), write=True),
        Grant(("hset", "hget", "hgetall"), ("versions",), write=True),
    ),
    # Dashboard and `squall status`: reads everything of the run, writes nothing.
    "monitor": (
        Grant(STREAM_READ + STREAM_GROUP_INFO + HASH_READ + KEY_INFO, ("*",), write=False),
        Grant(RQ_READ, (RQ_KEYS,), write=False),  # the tool pool's queues and workers
    ),
    # The tool pool (`squall worker`): rq's keys only, nothing of the run's streams or hashes.
    "worker": (Grant(RQ_READ + RQ_WRITE, (RQ_KEYS,), write=True),),
}
# Agents run inside the runner and enqueue tool jobs with its credentials (toolpool/client.py).
MATRIX["runner"] = (*MATRIX["runner"], Grant(RQ_READ + RQ_WRITE, (RQ_KEYS,), write=True))


def key_names(keys: Keys, name: str) -> str:
    """A Keys attribute's key, `*` for every key of the run, or rq's own pattern."""
    if name == RQ_KEYS:
        return RQ_KEYS
    return keys.key_for("*") if name == "*" else getattr(keys, name)


def rules_for(service: str, keys: Keys) -> list[str]:
    """The ACL rules (root grant first, then selectors) of one service user, without the password."""
    grants = (*MATRIX[service], *(_COMMON_GRANTS if service not in ("monitor", "worker") else ()))
    parts = ["on", "resetchannels", "resetkeys", "-@all"]
    parts += [f"+{c}" for c in (*CONNECTION, *(WRITER_KEYLESS if service != "monitor" else ()))]
    if service == "worker":  # rq workers listen for stop/kill commands on their own channel
        parts += [f"+{c}" for c in RQ_WORKER_KEYLESS] + ["&rq:pubsub:*"]
    for grant in grants:
        commands = " ".join(f"+{c}" for c in _unique(grant.commands))
        prefix = "~" if grant.write else "%R~"
        patterns = " ".join(prefix + key_names(keys, name) for name in _unique(grant.keys))
        parts.append(f"({commands} {patterns})")
    return parts


def password_hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def acl_text(keys: Keys, passwords: dict[str, str]) -> str:
    """The ACL file: `default` off, one user per service, and `admin` (full rights)."""
    # An ACL file takes no comments: every line is a `user` line.
    lines = ["user default off resetpass resetkeys resetchannels -@all"]
    for service in SERVICES:
        rules = " ".join(rules_for(service, keys))
        lines.append(f"user squall-{service} {rules} #{password_hash(passwords[service])}")
    lines.append(f"user squall-{ADMIN_USER} on ~* &* +@all #{password_hash(passwords[ADMIN_USER])}")
    return "\n".join(lines) + "\n"


def redis_url(user: str, password: str, host: str, port: int, db: int, tls: bool) -> str:
    scheme = "rediss" if tls else "redis"
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/{db}"


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Create with `mode` from the start (never world-readable for an instant), then replace."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, mode)  # umask may have narrowed it; an existing tmp kept its own
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_acl(
    out_dir: str | Path,
    run: str,
    *,
    passwords: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    port: int = 6379,
    db: int = 0,
    tls: bool = False,
    acl_mode: int = 0o600,
) -> dict[str, Path]:
    """Write `users.acl`, `<service>.env` and `<service>.url` (one per service user, plus admin)
    to `out_dir`.

    Returns name -> path. Given passwords are kept; missing ones are generated.
    """
    keys = Keys(run)
    out = Path(out_dir)
    if not out.is_dir():
        out.mkdir(mode=0o700, parents=True)  # a new folder of secrets: only its owner may list it
    chosen = dict(passwords or {})
    unknown = set(chosen) - {*SERVICES, ADMIN_USER}
    if unknown:
        raise SystemExit(
            f"--password for unknown user(s) {sorted(unknown)}: known are {[*SERVICES, ADMIN_USER]}"
        )
    for name in (*SERVICES, ADMIN_USER):
        chosen.setdefault(name, secrets.token_urlsafe(PASSWORD_BYTES))
    written = {"acl": out / ACL_FILE}
    _write_private(written["acl"], acl_text(keys, chosen), acl_mode)
    for name in (*SERVICES, ADMIN_USER):
        url = redis_url(f"squall-{name}", chosen[name], host, port, db, tls)
        body = (
            f"# squall {name}: Redis credentials for run {run!r} (secret: keep mode 0600)\n"
            f"SQUALL_RUN__NAME={run}\nSQUALL_RUN__REDIS_URL={url}\nSQUALL_RUN__AUTOSTART_REDIS=false\n"
        )
        written[name] = out / f"{name}.env"
        _write_private(written[name], body)
        # The URL alone, for a container that mounts it and reads it through
        # SQUALL_RUN__REDIS_URL_FILE (nothing secret in its environment); mode `acl_mode` like
        # users.acl, since the container's user is not the host user who owns the file.
        written[f"{name}.url"] = out / f"{name}.url"
        _write_private(written[f"{name}.url"], url + "\n", acl_mode)
    return written


def default_out_dir(run: str) -> Path:
    """`$XDG_CONFIG_HOME/squall/secrets/<run>` (else `~/.config/...`): outside any checkout, so
    the passwords are never one `git add -A` away from a commit."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "squall" / "secrets" / run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", default=os.environ.get("SQUALL_RUN__NAME", "default"), help="run name")
    parser.add_argument(
        "--out",
        help="folder for users.acl and the env files (default $XDG_CONFIG_HOME/squall/secrets/RUN, "
        "else ~/.config/squall/secrets/RUN; created mode 0700)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Redis host the services connect to")
    parser.add_argument("--port", type=int, default=6379, help="Redis port")
    parser.add_argument("--db", type=int, default=0, help="Redis database number")
    parser.add_argument("--tls", action="store_true", help="write rediss:// URLs (TLS)")
    parser.add_argument(
        "--password",
        action="append",
        default=[],
        metavar="USER=SECRET",
        help="use this password instead of a generated one (user: scheduler, runner, trainer, "
        "inference, monitor, worker, admin); repeatable",
    )
    parser.add_argument(
        "--acl-mode",
        default="600",
        help="octal mode of users.acl and the <user>.url files (640/644 when redis-server or a "
        "container reads them as another user; the folder itself stays 0700)",
    )
    parser.add_argument("--print", action="store_true", help="print the ACL file (hashes only) to stdout")


def main(args: argparse.Namespace) -> int:
    passwords = {}
    for item in args.password:
        user, sep, secret = item.partition("=")
        if not sep or not secret:
            print(f"squall acl: --password wants USER=SECRET, got {user!r}=…", file=sys.stderr)
            return 2
        passwords[user] = secret
    out = Path(args.out) if args.out else default_out_dir(args.run)
    written = write_acl(
        out,
        args.run,
        passwords=passwords,
        host=args.host,
        port=args.port,
        db=args.db,
        tls=args.tls,
        acl_mode=int(args.acl_mode, 8),
    )
    if args.print:
        print(written["acl"].read_text(), end="")
    names = ", ".join(p.name for k, p in written.items() if k != "acl")
    print(
        f"squall acl: wrote {written['acl']} and {names} in {out} "
        f"(secrets: .env mode 0600, users.acl and .url mode {args.acl_mode})",
        file=sys.stderr,
    )
    return 0
