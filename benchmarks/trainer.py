"""Trainer data path vs one optimizer step, in the same run.

Data path = what the trainer does before the model sees a batch: XREADGROUP + msgpack decode
+ validation of every trajectory, group assembly, filters and advantages, turns -> merged
masked samples, loss weights, micro-batch packing and padding into tensors. It is timed
over the whole stream (trajectories/s), then compared with one optimizer step on the tiny
model fed one step's worth of those groups. Target: the data path of one step costs
< 5 % of the step.

    .venv/bin/python benchmarks/trainer.py [--groups 64 --group-size 8 --turns 3 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from squall.shared import bus
from squall.shared.config import load_config
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.localredis import LocalRedis
from squall.shared.schemas import Trajectory, Turn, pack_logprobs, pack_tokens
from squall.trainer.backend import make_backend
from squall.trainer.filters import decide_group
from squall.trainer.groups import GroupAssembler
from squall.trainer.sequences import collate, pack_microbatches, token_weights, trajectory_to_samples


def make_trajectories(run: str, groups: int, size: int, turns: int, prompt: int, response: int, obs: int,
                      vocab: int, seed: int) -> list[Trajectory]:  # fmt: skip
    """Multi-turn trajectories whose turns extend each other (so they merge), in-vocab ids."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        for i in range(size):
            history = rng.integers(1, vocab, prompt).tolist()
            made = []
            for _ in range(turns):
                resp = rng.integers(1, vocab, response).tolist()
                logprobs = (-rng.exponential(1.0, response)).astype(np.float32)
                made.append(Turn(model="policy", prompt_ids=pack_tokens(history), response_ids=pack_tokens(resp),
                                 response_logprobs=pack_logprobs(logprobs), version=0))  # fmt: skip
                history = history + resp + rng.integers(1, vocab, obs).tolist()
            out.append(Trajectory(
                run=run, task_id=f"g{g}:{i}", group_id=f"g{g}", sample_id=f"s{g}", index=i, group_size=size,
                attempt=0, runner_id="bench", status="ok", reward=float(rng.integers(0, 2)), turns=made,
            ))  # fmt: skip
    return out


def data_path(r, keys: Keys, config, vocab: int, pad_id: int) -> tuple[float, list, int]:
    """Stream -> decisions -> padded tensors for every group; returns (seconds, step batches, trajectories)."""
    consumer = bus.GroupConsumer(r, keys.trajectories, GROUP_TRAINER, "bench", kind=Trajectory,
                                 deadletter_stream=keys.deadletter)  # fmt: skip
    assembler = GroupAssembler(group_wait_s=600, max_attempts=3)
    cfg = config.trainer
    steps, seen = [], 0
    start = time.perf_counter()
    ready = []
    while True:
        deliveries = consumer.read(512, block_ms=1)
        if not deliveries:
            break
        for d in deliveries:
            assembler.add(d.entry_id, d.message)
        seen += len(deliveries)
        for group in assembler.pop_complete():
            ready.append(decide_group(group.group_id, [m.trajectory for m in group.members], trainer_version=0,
                                      max_staleness=cfg.max_staleness, overlong=cfg.overlong,
                                      max_seq_len=cfg.max_seq_len, advantage=cfg.advantage))  # fmt: skip
        while len(ready) >= cfg.groups_per_step:
            batch, ready = ready[: cfg.groups_per_step], ready[cfg.groups_per_step :]
            samples = [s for d in batch for t in d.train
                       for s in trajectory_to_samples(t, advantage=d.advantages[t.key], mask_truncated=True)]  # fmt: skip
            weights = token_weights(samples, cfg.loss_agg)
            tensors = []
            for idx in pack_microbatches([s.length for s in samples], cfg.max_tokens_per_microbatch):
                arrays = collate([samples[i] for i in idx], [weights[i] for i in idx], pad_id)
                tensors.append({k: torch.from_numpy(v) for k, v in arrays.items()})
            steps.append(samples)
    return time.perf_counter() - start, steps, seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=96, help="tokens of the first prompt")
    parser.add_argument("--response", type=int, default=64, help="tokens per response")
    parser.add_argument("--obs", type=int, default=24, help="tool/observation tokens between turns")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps timed (median reported)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from squall.inference.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_tiny_model(Path(tmp) / "model")
        server = LocalRedis(data_dir=Path(tmp) / "redis").start()
        try:
            import redis

            r = redis.Redis.from_url(server.url)
            keys = Keys("bench")
            config = load_config(env={}, overrides={
                "run": {"name": "bench", "dir": str(Path(tmp) / "run")}, "model": {"path": str(model_path)},
                "trainer": {"groups_per_step": args.groups_per_step, "device": "cpu", "max_seq_len": 100_000},
            })  # fmt: skip
            backend = make_backend("torch", config)
            trajectories = make_trajectories("bench", args.groups, args.group_size, args.turns, args.prompt,
                                             args.response, args.obs, backend.vocab_size, 0)  # fmt: skip
            bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
            for i in range(0, len(trajectories), 256):
                bus.publish_many(r, keys.trajectories, trajectories[i : i + 256])
            seconds, steps, seen = data_path(r, keys, config, backend.vocab_size, backend.pad_id)
            per_step_data_s = seconds / max(len(steps), 1)
            step_times = []
            for samples in steps[: args.steps]:
                start = time.perf_counter()
                metrics = backend.train_step(samples)
                step_times.append(time.perf_counter() - start)
            step_s = float(np.median(step_times))
            tokens = sum(s.length for s in steps[0])
            result = {
                "trajectories": seen,
                "trajectories_per_s": seen / seconds,
                "data_path_s_per_step": per_step_data_s,
                "optimizer_step_s": step_s,
                "data_path_share_of_step": per_step_data_s / step_s,
                "trajectories_per_step": args.groups_per_step * args.group_size,
                "tokens_per_step": tokens,
                "trained_tokens_per_step": int(metrics["tokens"]),
                "microbatches_per_step": int(metrics["microbatches"]),
                "torch_threads": args.threads,
                "model": f"squall.inference.tiny (Qwen2, hidden 64, 2 layers, vocab {backend.vocab_size})",
            }
            print(json.dumps(result, indent=2))
        finally:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
