"""Learning claims of the trainer's other algorithms on the calculator task, side by side.

Three `squall up` runs of the calculator demo (examples/calc/demo.toml) from the same warm
start (examples/calc/policy), the same data, seed and budget of training problems, one after
another on this machine:

1. grpo           GRPO, as the demo. Its final weights become the teacher of run 2.
2. opd            on-policy distillation from that teacher (trainer.distill_url: a
                  `squall inference --no-follow` node serving the teacher), no task reward.
3. sft_then_grpo  SFT on the run's own successful trajectories (trainer.sft = "only",
                  sft_threshold 1) for the first --sft-steps optimizer steps, then GRPO.

For each run: the held-out validation reward per weight version (val_every versions apart),
and the first version whose validation reward reaches the teacher's end reward minus 0.05
(the OPD claim: fewer optimizer steps than GRPO from the same start). One PNG with the three
curves, one JSON summary, and one line per run on stdout.

    .venv/bin/python benchmarks/algos.py --samples 160 --val-every 4 --out runs/bench-algos

`--task calc_real` runs the same comparison on examples/calc_real (SmolLM2-135M-Instruct, LoRA,
`make real-model` first): there the teacher ends far ahead of the start (0.13-0.29 -> ~0.96),
the setting on-policy distillation is for; a LoRA teacher is merged into the base to be served.

    .venv/bin/python benchmarks/algos.py --task calc_real --samples 24 --val-every 2 --val-samples 32 \
        --minutes 14 --only grpo,opd --distill-coef 4 --distill-reward-coef 1 --out runs/bench-opd-real
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx

from squall import api
from squall.shared.localredis import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Task:
    """A run file, the model it starts from, and the command that writes its data."""

    run_file: Path
    warm_start: Path
    data: Path
    write_data: list[str]


TASKS = {
    # the calculator demo on the tiny warm-started policy
    "calc": Task(ROOT / "examples/calc/demo.toml", ROOT / "examples/calc/policy", ROOT / "runs/calc-data",
                 ["examples.calc.tasks", "--train", "4000", "--val", "200", "--seed", "0"]),
    # two-digit products through the calculator on SmolLM2-135M-Instruct (LoRA; `make real-model`):
    # the teacher, trained from the same start, ends far ahead of the student (0.13 -> 1.00)
    "calc_real": Task(ROOT / "examples/calc_real/real.toml", ROOT / "runs/models/smollm2-135m-instruct",
                      ROOT / "runs/calc-real-data",
                      ["examples.calc_real.tasks", "--train", "2000", "--val", "32", "--seed", "0"]),
}  # fmt: skip


def base_config(args: argparse.Namespace, name: str) -> dict:
    task = TASKS[args.task]
    config = tomllib.loads(task.run_file.read_text())
    out = Path(args.out)
    config["run"].update(
        name=name, dir=str(out / name), redis_url=f"redis://127.0.0.1:{free_port()}/0", seed=args.seed
    )
    config["model"]["path"] = str(task.warm_start)
    config["scheduler"].update(
        dataset=str(task.data / "train.jsonl"),
        val_dataset=str(task.data / "val.jsonl"),
        max_samples=args.samples,
        val_every=args.val_every,
        val_samples=args.val_samples,
    )
    return config


def run(config: dict, minutes: float) -> dict:
    started = time.time()
    result = api.up(config, minutes=minutes)
    summary = dict(result.summary)
    summary["wall_s"] = time.time() - started
    summary["exit_code"] = result.exit_code
    summary["reason"] = result.reason
    return summary


def newest_weights(run_dir: Path) -> Path:
    """The newest published version's folder (one safetensors file, or shards and their index)."""
    versions = sorted(
        p
        for p in (run_dir / "weights").glob("v*")
        if any(p.glob("*.safetensors")) and "-merged" not in p.name
    )
    if not versions:
        raise SystemExit(f"{run_dir}: no published weights to make a teacher of")
    return versions[-1]


def make_teacher(run_dir: Path, out: Path, warm_start: Path) -> Path:
    """The warm start's folder (config, tokenizer) with the run's newest weights (a LoRA
    adapter merged into the warm start first, by race.merged: the race's one merge path)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(warm_start, out)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    newest = newest_weights(run_dir)
    if (newest / "adapter_config.json").is_file():
        from race import merged

        newest = merged(newest, warm_start)
    for path in newest.glob("model*.safetensors*"):
        shutil.copy(path, out / path.name)
    return out


def serve_teacher(folder: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "squall.cli", "inference", "--model", str(folder), "--port", str(port),
         "--no-follow", "--served-name", "teacher"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},  # noqa: SIM115
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the teacher server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the teacher server did not come up within 180 s")


def first_reaching(curve: list[dict], target: float) -> int | None:
    for point in curve:
        if point.get("mean") is not None and point["mean"] >= target:
            return int(point["version"])
    return None


def plot(results: dict[str, dict], target: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, summary in results.items():
        curve = [p for p in summary.get("val_curve", []) if p.get("mean") is not None]
        ax.plot([p["version"] for p in curve], [p["mean"] for p in curve], marker="o", label=name)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", label="teacher end - 0.05")
    ax.set_xlabel("weight version (one optimizer step each)")
    ax.set_ylabel("held-out reward (validation)")
    ax.set_title("calculator task: GRPO, OPD from the GRPO policy, SFT then GRPO")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--samples", type=int, default=160, help="training problems per run (4 groups a step)"
    )
    parser.add_argument("--val-every", type=int, default=4)
    parser.add_argument("--val-samples", type=int, default=100)
    parser.add_argument("--sft-steps", type=int, default=10, help="SFT steps before GRPO in sft_then_grpo")
    parser.add_argument("--minutes", type=float, default=12.0, help="time limit of each run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distill-coef", type=float, default=1.0,
                        help="opd's trainer.distill_coef: the scale of its per-token reverse-KL advantage")  # fmt: skip
    parser.add_argument("--distill-reward-coef", type=float, default=0.0,
                        help="opd's trainer.distill_reward_coef: the task reward's GRPO advantage mixed in")  # fmt: skip
    parser.add_argument("--only", default="grpo,opd,sft_then_grpo", help="comma-separated runs")
    parser.add_argument("--out", default="runs/bench-algos")
    parser.add_argument(
        "--task", choices=sorted(TASKS), default="calc", help="calc (tiny policy) or calc_real"
    )
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    task = TASKS[args.task]
    if not (task.data / "val.jsonl").exists():
        subprocess.run(
            [sys.executable, "-m", *task.write_data, "--out", str(task.data)], check=True, cwd=ROOT
        )
    chosen = args.only.split(",")
    results: dict[str, dict] = {}
    saved = out / "results.json"
    if saved.exists():
        results = json.loads(saved.read_text())
    if "grpo" in chosen:
        results["grpo"] = run(base_config(args, "grpo"), args.minutes)
        saved.write_text(json.dumps(results, indent=1, default=str))
    elif "grpo" not in results and (out / "grpo/summary.json").exists():  # an earlier grpo run's
        results["grpo"] = json.loads((out / "grpo/summary.json").read_text())
    target = None
    if "grpo" in results and results["grpo"].get("val_reward_end") is not None:
        target = results["grpo"]["val_reward_end"] - 0.05
    if "opd" in chosen:
        teacher = make_teacher(out / "grpo", out / "teacher", task.warm_start)
        proc, url = serve_teacher(teacher, out / "teacher.log")
        try:
            config = base_config(args, "opd")
            config["trainer"].update(
                distill_url=url,
                distill_model="teacher",
                distill_coef=args.distill_coef,
                distill_reward_coef=args.distill_reward_coef,
            )
            results["opd"] = run(config, args.minutes)
            saved.write_text(json.dumps(results, indent=1, default=str))
        finally:
            proc.terminate()
            proc.wait(20)
    if "sft_then_grpo" in chosen:
        config = base_config(args, "sft_then_grpo")
        config["trainer"].update(sft="only", sft_threshold=1.0, sft_until_step=args.sft_steps)
        results["sft_then_grpo"] = run(config, args.minutes)
    for summary in results.values():
        summary["first_version_at_target"] = (
            first_reaching(summary.get("val_curve", []), target) if target is not None else None
        )
    saved.write_text(json.dumps(results, indent=1, default=str))
    plot(results, target, out / "algos_curve.png")
    for name, s in results.items():
        print(
            f"{name:14s} val {s.get('val_reward_start')} -> {s.get('val_reward_end')} "
            f"(version {s.get('val_reward_end_version')}), steps {s.get('steps')}, "
            f"first version >= teacher-0.05 ({target if target is None else round(target, 3)}): "
            f"{s.get('first_version_at_target')}, wall {s.get('wall_s', 0):.0f}s, exit {s.get('exit_code')} ({s.get('reason')})"
        )
    print(f"curve: {out / 'algos_curve.png'}  results: {saved}")


if __name__ == "__main__":
    main()
