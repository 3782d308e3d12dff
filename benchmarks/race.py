"""The race: squall (async), squall (synchronous) and TRL's GRPOTrainer train the same model on
the same agent task on the same machine; one evaluator scores every checkpoint on held-out
problems; the report is held-out reward against wall-clock time and the time to a target.

    python benchmarks/race.py --minutes 15 --target 0.2 --out runs/race

Contenders (each one command, run one after another so none shares the CPU with another):
- squall_async: `squall up --config <task>/real.toml`, the task's own run file as it is;
- squall_sync: the same with scheduler.max_dispatch_lag = 0 and trainer.max_sample_age = 0
  (no rollout on weights older than the newest, no sample trained off-policy);
- trl: benchmarks/race_trl.py in the TRL venv (`make trl-venv`), GRPOTrainer with the run
  file's hyperparameters mapped onto GRPOConfig (`matched_params`).

The task is a parameter (`--task`, a package like examples.calc_real): its tasks.generate makes
the data, its agent (the agent, its tools and reward_of) drives training in squall, the TRL
rollout (race_trl.py) and the evaluation, and its real.toml is squall's run file. Every
contender's in-run validation is off; the shared evaluator (`Evaluator`) serves each checkpoint
with `squall inference --no-follow` (the run file's inference section) and runs the task's own
agent on the same held-out problems, one attempt each, sampled as in training.

Checkpoints: squall keeps every published version (trainer.keep_versions raised), dated by its
index file's mtime; TRL saves every --save-every steps (race_trl.py). Time is seconds from the
contender's launch, model loading included. Per contender: generated tokens/s (both turns of
every finished attempt: squall's kept rollouts, all of them kept; TRL's two generate calls),
trainer-busy fraction (squall: train + publish seconds per wall second; TRL: step seconds less
generation and scoring), peak RSS of the contender's whole process tree (Redis included for
squall). The last line is `race: target=... squall_async_s=... ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONTENDERS = ("squall_async", "squall_sync", "trl")
BASE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
TEMPERATURE = 1.0  # what the calc agents sample at, in both turns
# squall through this interpreter's module, not a console script beside it: that works wherever
# `import squall` does (a venv, a `pip install --target` folder on PYTHONPATH, a source tree).
SQUALL = [sys.executable, "-m", "squall.cli"]


def default_trl_python() -> str:
    return os.environ.get("SQUALL_TRL_PYTHON", str(ROOT / ".venv-trl" / "bin" / "python"))


# --- the task ------------------------------------------------------------------------------


def task_run_file(task: str) -> Path:
    return ROOT / task.replace(".", "/") / "real.toml"


def write_data(task: str, out: Path, train: int, val: int, seed: int) -> tuple[Path, Path]:
    """The task's own generator writes train.jsonl and val.jsonl under `out`."""
    tasks = importlib.import_module(f"{task}.tasks")
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "val.jsonl"
    for path, split, n in zip(paths, ("train", "val"), (train, val), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in tasks.generate(split, n, seed)))
    return paths


def matched_params(task: str) -> dict[str, Any]:
    """The hyperparameters both trainers get: the task's squall run file as squall reads it (a
    SQUALL_<SECTION>__<FIELD> variable overrides it for both trainers alike)."""
    from squall.shared.config import load_config

    cfg = load_config(task_run_file(task))
    t = cfg.trainer
    return {
        "group_size": cfg.scheduler.group_size,
        "groups_per_step": t.groups_per_step,
        "lr": t.lr,
        "clip_low": t.clip_low,
        "clip_high": t.clip_high,
        "kl_coef": t.kl_coef,
        "grad_clip": t.grad_clip,
        "gradient_checkpointing": t.gradient_checkpointing,
        "lora_rank": t.lora_rank,
        "lora_alpha": t.lora_alpha,
        "lora_dropout": t.lora_dropout,
        "lora_target_modules": list(t.lora_target_modules),
        "chat_template": cfg.inference.chat_template,
        "tool_parser": cfg.inference.tool_parser,
        "temperature": TEMPERATURE,
        "seed": cfg.run.seed,
    }


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --- measuring a process tree ----------------------------------------------------------------


class TreeRss:
    """Peak resident memory of a process and all its descendants, sampled twice a second."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                total = 0
                for proc in procs:
                    try:
                        total += proc.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            self._stop.wait(0.5)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def run_logged(cmd: list[str], log: Path, env: dict[str, str], deadline_s: float) -> tuple[int, float, int]:
    """Run `cmd` (niced like everything here) to its end or the deadline; (rc, wall s, peak RSS)."""
    began = time.time()
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            ["nice", "-n", os.environ.get("RACE_NICE", "10"), *cmd], stdout=handle, stderr=subprocess.STDOUT,
            env={**os.environ, **env}, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        rss = TreeRss(proc.pid)
        try:
            rc = proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            rc = stop_group(proc, grace_s=60)
    return rc, time.time() - began, rss.stop()


def stop_group(proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM the process group `proc` leads, SIGKILL it after `grace_s`; its exit code. A
    group already gone (the process exited on its own) is no error: its own failure is the
    one worth reporting."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


# --- contenders ----------------------------------------------------------------------------


def model_folder(base: Path, weights: Path, folder: Path) -> Path:
    """A Hugging Face folder: `weights`' files (a squall version) beside the base's tokenizer and config."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in [*(base / n for n in BASE_FILES), *weights.iterdir()]:
        link = folder / source.name
        if source.is_file() and not link.exists():
            link.symlink_to(source.resolve())
    return folder


def run_squall(
    name: str, args: argparse.Namespace, data: tuple[Path, Path], port: int, where: Path
) -> dict[str, Any]:
    from squall.shared.weightfiles import version_dir

    out = where / name
    run_dir = out / "run"
    env = {
        "SQUALL_RUN__NAME": f"race-{name}",
        "SQUALL_RUN__DIR": str(run_dir),
        "SQUALL_RUN__REDIS_URL": f"redis://127.0.0.1:{port}/0",
        "SQUALL_MODEL__PATH": str(args.model),
        "SQUALL_SCHEDULER__DATASET": str(data[0]),
        "SQUALL_SCHEDULER__VAL_DATASET": "",
        "SQUALL_SCHEDULER__VAL_EVERY": "0",
        "SQUALL_TRAINER__KEEP_VERSIONS": "100000",
        "SQUALL_SCHEDULER__KEEP_ROLLOUTS_PER_VERSION": "1000000",  # every attempt, for its tokens
        "SQUALL_TRAINER__MAX_STEPS": str(args.max_steps),
        "SQUALL_TRAINER__DEVICE": args.device,
        "SQUALL_INFERENCE__DEVICE": args.device,
    }
    if name == "squall_sync":
        env |= {"SQUALL_SCHEDULER__MAX_DISPATCH_LAG": "0", "SQUALL_TRAINER__MAX_SAMPLE_AGE": "0"}
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*SQUALL, "up", "--config", str(task_run_file(args.task)), "--minutes", str(args.minutes)]
    began = time.time()
    rc, wall, peak = run_logged(cmd, out / "log.txt", env, args.minutes * 60 + 300)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    summary = load_json(run_dir / "summary.json", {})  # `squall up`'s final report
    checkpoints = []
    for m in metrics:
        folder = version_dir(run_dir, int(m["version"]))
        if folder.is_dir() and any(folder.iterdir()):
            written = max(p.stat().st_mtime for p in folder.iterdir())
            ckpt = model_folder(args.model, folder, out / f"ckpt-{int(m['step']):06d}")
            checkpoints.append({"step": int(m["step"]), "time_s": written - began, "path": str(ckpt)})
    busy = sum(m.get("time/train_s", 0.0) + m.get("time/publish_s", 0.0) for m in metrics)
    return {
        "name": name, "rc": rc, "wall_s": wall, "peak_rss": peak, "steps": len(metrics),
        "checkpoints": checkpoints, "tokens_per_s": generated_tokens(run_dir) / wall,
        "trained_tokens_per_s": sum(m.get("tokens", 0.0) for m in metrics) / wall,
        "trainer_busy": busy / wall, "command": "squall up ... " + " ".join(f"{k}={v}" for k, v in env.items()),
        "profile": squall_profile(metrics, wall) | {"stale_dropped": stale_dropped(summary)},
        "log": str(out / "log.txt"), "warnings": summary.get("warnings", []),
    }  # fmt: skip


def stale_dropped(summary: dict) -> float:
    """Finished attempts the trainer dropped as older than trainer.max_sample_age (rollouts spent
    for nothing), from the run's final ledger (`squall up`'s summary.json): the step metrics miss
    those committed between steps."""
    return float(summary.get("ledger", {}).get("filtered:stale", 0))


def generated_tokens(run_dir: Path) -> int:
    """Tokens sampled in every finished attempt of the run (the scheduler keeps them all here)."""
    from squall.monitor.rollouts import read_kept

    return sum(len(turn.response_ids) // 4 for r in read_kept(run_dir) for turn in r.trajectory.turns)


def squall_profile(metrics: list[dict], wall: float) -> dict[str, float]:
    """Where the trainer's wall time went: waiting for groups, training, publishing."""
    out = {k: sum(m.get(f"time/{k}", 0.0) for m in metrics) for k in ("wait_s", "train_s", "publish_s")}
    out["wall_s"] = wall
    return out


def run_trl(args: argparse.Namespace, data: tuple[Path, Path], where: Path) -> dict[str, Any]:
    out = where / "trl"
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoints.jsonl").unlink(missing_ok=True)
    cmd = [
        args.trl_python, str(ROOT / "benchmarks" / "race_trl.py"), "--model", str(args.model),
        "--data", str(data[0]), "--out", str(out), "--task", args.task, "--minutes", str(args.minutes),
        "--max-steps", str(args.max_steps), "--save-every", str(args.save_every),
        "--params", json.dumps(matched_params(args.task)), "--threads", str(args.trl_threads),
        "--device", args.device,
    ]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # everything it needs is local
    rc, wall, peak = run_logged(cmd, out / "log.txt", offline, args.minutes * 60 + 300)
    stats = json.loads((out / "stats.json").read_text()) if (out / "stats.json").is_file() else {}
    train_s = max(stats.get("step_s", 0.0) - stats.get("gen_s", 0.0), 0.0)
    return {
        "name": "trl", "rc": rc, "wall_s": wall, "peak_rss": peak, "steps": stats.get("steps", 0),
        "checkpoints": read_jsonl(out / "checkpoints.jsonl"),
        "tokens_per_s": stats.get("generated_tokens", 0) / wall, "trainer_busy": train_s / wall,
        "command": " ".join(cmd[:2]) + " ...", "device": stats.get("device", "cpu"), "log": str(out / "log.txt"),
        "profile": {"generate_and_score_s": stats.get("gen_s", 0.0), "of_which_turn2_s": stats.get("answer_s", 0.0),
                    "train_s": train_s, "wall_s": wall},
    }  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


# --- the shared evaluator --------------------------------------------------------------------


def merged(folder: Path, base_model: Path) -> Path:
    """A LoRA checkpoint (adapter_config.json: squall's published adapter or TRL's peft save) as a
    full model folder beside it, the adapter merged into `base_model`; a full
    model folder as it is. Both contenders' adapters go through this one merge."""
    if not (folder / "adapter_config.json").is_file():
        return folder
    out = folder.with_name(folder.name + "-merged")
    if (out / "config.json").is_file():
        return out
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    model.save_pretrained(out, safe_serialization=True)
    for name in BASE_FILES:
        if (folder / name).is_file():
            (out / name).write_bytes((folder / name).read_bytes())
    return out


class Evaluator:
    """Held-out reward of one checkpoint: serve it with `squall inference --no-follow` and run the
    task's agent once on each held-out problem (sampled as in training)."""

    def __init__(
        self, task: str, val: Path, port: int, base_model: Path, threads: int = 2, device: str = "cpu"
    ) -> None:
        from squall.shared.config import load_config

        self.base_model = base_model
        self.task, self.port = task, port
        self.agent = importlib.import_module(f"{task}.agent").agent
        self.problems = read_jsonl(val)
        # Scoring is not timed and runs after every contender has stopped, so the server may use
        # the whole machine: every held-out attempt at once in one batch, `threads` torch threads
        # (on 2 cores: 37 s instead of 51 s for 64 problems). Sampling is the same per attempt.
        self.concurrency = max(1, min(len(self.problems), 64))
        self.server_env = {
            "SQUALL_INFERENCE__TORCH_THREADS": str(threads),
            "SQUALL_INFERENCE__MAX_BATCH": str(self.concurrency),
            "SQUALL_INFERENCE__DEVICE": device,
        }
        self.served_name = load_config(task_run_file(task)).model.name

    def score(self, folder: str, log: Path) -> float:
        folder = str(merged(Path(folder), self.base_model))
        cmd = [
            *SQUALL, "inference", "--config", str(task_run_file(self.task)), "--model", folder,
            "--no-follow", "--port", str(self.port), "--run", "race-eval",
        ]  # fmt: skip
        with open(log, "a") as handle:
            proc = subprocess.Popen(
                ["nice", "-n", os.environ.get("RACE_NICE", "10"), *cmd], stdout=handle,
                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env={**os.environ, **self.server_env},
            )  # fmt: skip
        try:
            self._wait_ready(proc, deadline_s=300)
            outcomes = asyncio.run(self._attempts())
        finally:
            stop_group(proc, grace_s=30)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:  # the agent never raises for a bad answer: this is the server or the network
            raise RuntimeError(
                f"{len(failures)} of {len(outcomes)} held-out attempts on {folder} failed "
                f"({failures[0]!r}); not scored as 0, since the fault is not the model's. "
                f"See {log}, then rerun with --resume to score what is left."
            )
        return sum(outcomes) / len(outcomes)  # type: ignore[arg-type]

    def _wait_ready(self, proc: subprocess.Popen, deadline_s: float) -> None:
        end = time.time() + deadline_s
        while time.time() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"evaluation server exited with {proc.returncode} (see its log)")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"evaluation server not ready on port {self.port} within {deadline_s}s")

    async def _attempts(self) -> list[float | BaseException]:
        llm = types.SimpleNamespace(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", model=self.served_name
        )
        gate = asyncio.Semaphore(self.concurrency)

        async def one(problem: dict) -> float:
            async with gate:
                return float(await self.agent(problem, llm))

        return list(await asyncio.gather(*(one(p) for p in self.problems), return_exceptions=True))


def pick(checkpoints: list[dict], n: int) -> list[dict]:
    """Up to `n` checkpoints, evenly spaced, always the last; every one when `n` is 0."""
    if n <= 0 or len(checkpoints) <= n:
        return checkpoints
    step = (len(checkpoints) - 1) / (n - 1) if n > 1 else 0
    return [checkpoints[round(len(checkpoints) - 1 - i * step)] for i in reversed(range(n))]


# --- the report ----------------------------------------------------------------------------


def time_to_target(curve: list[tuple[float, float]], target: float, wall: float) -> tuple[float, bool]:
    """Seconds to the first trained checkpoint at or above `target` (the base model at t = 0 does
    not count: a target it already meets measures nothing), else the whole run and False."""
    for t, reward in curve[1:]:
        if reward >= target:
            return t, True
    return wall, False


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def spread(values: list[float], fmt: str = ".0f") -> str:
    """`median (min-max)`, or the one value."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def plot(repeats: list[dict[str, dict]], target: float, path: Path) -> None:
    """One colour per contender; each repeat is one line of its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(CONTENDERS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, results in enumerate(repeats):
        for name, result in results.items():
            xs, ys = zip(*result["curve"], strict=True)
            ax.plot(
                [x / 60 for x in xs], ys, marker="o", markersize=3, linewidth=1.2, alpha=0.8,
                color=colours[name], label=name if i == 0 else None,
            )  # fmt: skip
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set_xlabel("wall-clock minutes from launch")
    ax.set_ylabel("held-out reward (shared evaluator)")
    if len(repeats) > 1:
        ax.set_title(f"{len(repeats)} repeats, one line each", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(repeats: list[dict[str, dict]], target: float) -> str:
    lines = [
        f"| repeat | contender | steps | wall s | time to {target} s | final held-out reward | generated tok/s | trainer busy | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, results in enumerate(repeats, 1):
        for name, r in results.items():
            reached = f"{r['time_to_target_s']:.0f}" + ("" if r["reached"] else " (not reached)")
            lines.append(
                f"| {i} | {name} | {r['steps']} | {r['wall_s']:.0f} | {reached} | {r['curve'][-1][1]:.3f} | "
                f"{r['tokens_per_s']:.1f} | {r['trainer_busy']:.2f} | {r['peak_rss'] / 2**30:.2f} |"
            )
    return "\n".join(lines)


def steps_to_target(run: dict, target: float) -> int | None:
    """The trainer step of the first checkpoint at or above `target`, None if none was."""
    t, reached = time_to_target(run["curve"], target, run["wall_s"])
    return next((c["step"] for c in run["checkpoints"] if c["time_s"] == t), None) if reached else None


def summary(repeats: list[dict[str, dict]], targets: list[float], target: float) -> str:
    """Per contender over the repeats, median (min-max): time to each target (a run that never
    reaches one is charged its whole time, marked by the count of misses), the steps it took to
    reach `target` (time = steps x pace: which of the two a contender wins on) and seconds per
    step over the whole run."""
    heads = " | ".join(f"time to {t} s" for t in targets)
    lines = [
        f"| contender | {heads} | steps to {target} | s per step |",
        "|---|" + "---|" * (len(targets) + 2),
    ]
    for name in repeats[0]:
        runs = [results[name] for results in repeats]
        cells = []
        for t in targets:
            hits = [time_to_target(r["curve"], t, r["wall_s"]) for r in runs]
            missed = sum(not ok for _, ok in hits)
            cells.append(spread([s for s, _ in hits]) + (f", {missed} not reached" if missed else ""))
        steps = [s for r in runs if (s := steps_to_target(r, target)) is not None]
        cells.append(spread([float(s) for s in steps]) if steps else "-")
        per_step = [r["wall_s"] / r["steps"] for r in runs if r["steps"]]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {spread(per_step, '.1f') if per_step else '-'} |"
        )
    return "\n".join(lines)


def final_lines(repeats: list[dict[str, dict]], target: float) -> list[str]:
    """The race line on the median time of each contender over the repeats (with one repeat, its
    times), preceded, when there are several, by each repeat's own ratios. Without TRL (a run of
    the two squall set-ups only) the line is `race async vs sync: ...`; a run without both squall
    set-ups has no ratio to give."""
    names = set(repeats[0])
    times = {n: [results[n]["time_to_target_s"] for results in repeats] for n in names}
    if not {"squall_async", "squall_sync"} <= names:
        return []
    pairs = [("speedup_vs_trl", "trl"), ("async_vs_sync", "squall_sync")]
    pairs = [(label, other) for label, other in pairs if other in names]
    lines = []
    if len(repeats) > 1:
        per_repeat = [
            f"{label}=[" + ", ".join(f"{o / a:.2f}" for a, o in zip(times["squall_async"], times[other], strict=True)) + "]"
            for label, other in pairs
        ]  # fmt: skip
        lines.append("race repeats: " + " ".join(per_repeat))
    med = {n: median(times[n]) for n in names}
    seconds = " ".join(f"{n}_s={med[n]:.0f}" for n in CONTENDERS if n in names)
    ratios = " ".join(f"{label}={med[other] / med['squall_async']:.2f}" for label, other in pairs)
    head = "race" if "trl" in names else "race async vs sync"
    lines.append(f"{head}: target={target} {seconds} {ratios}")
    return lines


# --- the run ---------------------------------------------------------------------------------


def load_json(path: Path, default: Any) -> Any:
    return json.loads(path.read_text()) if path.is_file() else default


def save_json(path: Path, value: Any) -> None:
    """Whole or not at all: a report cut off mid-write would lose every result before it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def train_all(
    args: argparse.Namespace, names: list[str], data: tuple[Path, Path], redis_port: int
) -> list[dict]:
    """Every repeat's training runs, one contender at a time. Each repeat has its own seed (the run
    file's plus --seed-offset plus the repeat's index, both trainers alike) and starts with the next contender in
    turn, so no contender always runs first on a cold machine. With --resume, runs already in
    trained.json are kept, those that failed to train are run again."""
    ledger = args.out / "trained.json"
    repeats: list[dict] = load_json(ledger, []) if args.resume else []
    repeats = [{n: run for n, run in results.items() if trained(run)} for results in repeats]
    seed = matched_params(args.task)["seed"] + args.seed_offset
    for rep in range(args.repeats):
        if rep == len(repeats):
            repeats.append({})
        os.environ["SQUALL_RUN__SEED"] = str(seed + rep)  # squall reads it; matched_params passes it to TRL
        where = args.out if args.repeats == 1 else args.out / f"repeat-{rep + 1}"
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if name in repeats[rep]:
                continue
            print(f"race: repeat {rep + 1}/{args.repeats}: running {name} ({args.minutes} min)", flush=True)
            run = (
                run_trl(args, data, where)
                if name == "trl"
                else run_squall(name, args, data, redis_port, where)
            )
            print(
                f"race: {name} done in {run['wall_s']:.0f}s, {len(run['checkpoints'])} checkpoints, rc={run['rc']}",
                flush=True,
            )
            repeats[rep][name] = run
            save_json(ledger, repeats)
    return [{n: results[n] for n in names} for results in repeats[: args.repeats]]


def trained(run: dict) -> bool:
    """The run exited 0 and left a checkpoint."""
    return run["rc"] == 0 and bool(run["checkpoints"])


def untrained(repeats: list[dict]) -> list[str]:
    """A line per run that did not train, saying what is known of why and where to look."""
    lines = []
    for rep, results in enumerate(repeats, 1):
        for name, run in results.items():
            if trained(run):
                continue
            why = f"exited {run['rc']}" if run["rc"] else f"left no checkpoint in {run['wall_s']:.0f} s"
            said = "".join(f"; it warned: {w}" for w in run.get("warnings", []))
            lines.append(f"race: repeat {rep} {name} {why}{said}; its log: {run.get('log', '?')}")
    return lines


def evaluate_all(
    args: argparse.Namespace, repeats: list[dict], val: Path, eval_port: int, goal: float
) -> None:
    """Score the base model once; of each run, every checkpoint up to the first at or above
    `goal` (the highest target: its times are exact) and after that the --evals picks. Fill in
    each run's curve and time to target. Scores are kept in scores.json as they come, so
    --resume scores nothing twice."""
    ledger = args.out / "scores.json"
    scores: dict[str, float] = load_json(ledger, {}) if args.resume else {}
    evaluator = Evaluator(
        args.task, val, eval_port, args.model, threads=args.eval_threads, device=args.device
    )

    def score(path: str) -> float:
        if path not in scores:
            scores[path] = evaluator.score(path, args.out / "eval.log")
            save_json(ledger, scores)
        return scores[path]

    print("race: evaluating the base model", flush=True)
    base = score(str(args.model))
    for rep, results in enumerate(repeats, 1):
        for name, run in results.items():
            curve = [(0.0, base)]
            picked = {c["path"] for c in pick(run["checkpoints"], args.evals)}
            dense = True  # every checkpoint until one reaches the highest target: exact times
            for ckpt in run["checkpoints"]:
                if not dense and ckpt["path"] not in picked:
                    continue
                reward = score(ckpt["path"])
                dense = dense and reward < goal
                print(
                    f"race: repeat {rep} {name} step {ckpt['step']} at {ckpt['time_s']:.0f}s: held-out reward {reward:.3f}",
                    flush=True,
                )
                curve.append((ckpt["time_s"], reward))
            run["curve"] = curve
            run["time_to_target_s"], run["reached"] = time_to_target(curve, args.target, run["wall_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--task", default="examples.calc_real", help="task package (tasks.py, agent.py, real.toml)"
    )
    parser.add_argument("--model", type=Path, default=ROOT / "runs/models/smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/race")
    parser.add_argument("--minutes", type=float, default=15.0, help="wall-clock limit per contender")
    parser.add_argument(
        "--max-steps", type=int, default=0, help="also stop each trainer after this many steps"
    )
    parser.add_argument("--target", type=float, default=0.2, help="held-out reward to reach")
    parser.add_argument(
        "--also-targets", default="", help="more targets for the summary table only, comma-separated"
    )
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--val", type=int, default=32, help="held-out problems per evaluation")
    parser.add_argument(
        "--evals", type=int, default=0,
        help="checkpoints scored per run after it first reaches the highest target, evenly spaced, "
        "the last always (0: every one; every checkpoint before that is scored anyway)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1, help="run every contender this many times (seed +1 each)"
    )
    parser.add_argument(
        "--seed-offset", type=int, default=0,
        help="repeat i trains with the run file's seed + this + i (more repeats on seeds not run before)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="keep the runs and scores already in --out (trained.json, scores.json) and do the rest",
    )  # fmt: skip
    parser.add_argument(
        "--train-only", action="store_true",
        help="train and write trained.json, score nothing (later: the same command with --resume scores)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-threads", type=int, default=2, help="torch threads of the (untimed) evaluation server"
    )
    parser.add_argument("--save-every", type=int, default=1, help="TRL: save every k steps")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--trl-python", default=default_trl_python())
    parser.add_argument(
        "--trl-threads", type=int, default=1,
        help="TRL's torch threads (default 1, as squall's trainer and inference node each use)",
    )  # fmt: skip
    parser.add_argument(
        "--base-port", type=int, default=0, help="first of two free ports (default: any free)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="where every contender trains and samples, and the evaluator serves (cuda: the first "
        "GPU; squall's trainer and TRL both train fp32 weights under bf16 autocast there, and "
        "squall's inference node serves bf16)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.model, args.out = args.model.resolve(), args.out.resolve()
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    try:
        extra = [float(t) for t in args.also_targets.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--also-targets {args.also_targets!r}: give numbers separated by commas, like 0.6,0.7")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json (make real-model builds it)")
    if args.device == "cuda" and not cuda_available():
        parser.error("--device cuda: torch sees no CUDA GPU here; run on a GPU machine or use --device cpu")
    if "trl" in names and not Path(args.trl_python).is_file():
        parser.error(f"--trl-python {args.trl_python} does not exist: run `make trl-venv`")
    from squall.shared.localredis import free_port

    redis_port, eval_port = (
        (args.base_port, args.base_port + 1) if args.base_port else (free_port(), free_port())
    )
    data = write_data(args.task, args.out / "data", args.train, args.val, matched_params(args.task)["seed"])
    repeats = train_all(args, names, data, redis_port)
    failed = untrained(repeats)
    if failed:  # a race with a contender missing is no race: say why, score nothing
        print("\n".join(failed) + "\nrace: fix that and rerun with --resume (runs that trained are kept)")
        return 1
    if args.train_only:
        print(
            f"race: trained {len(repeats)} repeat(s) into {args.out / 'trained.json'}; rerun with --resume to score"
        )
        return 0
    evaluate_all(args, repeats, data[1], eval_port, goal=max([args.target, *extra]))
    save_json(
        args.out / "race.json",
        {
            "target": args.target,
            "device": args.device,
            "params": matched_params(args.task),
            "repeats": repeats,
        },
    )
    plot(repeats, args.target, args.out / "race.png")
    print(table(repeats, args.target))
    print(summary(repeats, sorted({args.target, *extra}), args.target))
    for rep, results in enumerate(repeats, 1):
        for name, run in results.items():
            print(f"profile {rep} {name}: " + " ".join(f"{k}={v:.1f}" for k, v in run["profile"].items()))
    missed = sorted({n for results in repeats for n in names if not results[n]["reached"]})
    if missed:
        print(
            f"race: {', '.join(missed)} did not reach {args.target} in every repeat: "
            "a run that never reached it stands in with its whole time"
        )
    print("\n".join(final_lines(repeats, args.target)))
    if not all(n in names for n in CONTENDERS):
        print(f"race: ran {names} only, so no race line (it needs {list(CONTENDERS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
