"""Trainer data path vs one optimizer step, in the same run.

Data path = what the trainer does before the model sees a batch: XREADGROUP + msgpack decode
+ validation of every trajectory, group assembly, filters and advantages, turns -> merged
masked samples, loss weights, micro-batch packing and padding into tensors. It is timed
over the whole stream (trajectories/s), then compared with one optimizer step on the tiny
model fed one step's worth of those groups. Target: the data path of one step costs
< 5 % of the step.

    .venv/bin/python benchmarks/trainer.py [--groups 64 --group-size 8 --turns 3 ...]

`--publish`: weight publication instead, publish -> applied (the trainer's write + checksum +
announce until a real inference node, in its own process, acknowledged the version on
`weights:applied`) for the calc policy and a random Qwen2-0.5B-shaped model: a LoRA adapter
(rank 16), sharded (parallel and one thread) and one file, beside the disk's raw write +
fsync of as many bytes:

    .venv/bin/python benchmarks/trainer.py --publish [--publish-models calc-policy qwen2-0.5b]

`--world-sizes`: one optimizer step at world size 1 and 2 on CPU (FSDP over gloo), step time
and tokens/s, with what the second rank costs beyond an ideal halving:

    .venv/bin/python benchmarks/trainer.py --world-sizes [--rank-models tiny small --steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
from squall.shared.schemas import (
    ENTRY_FIELD,
    Trajectory,
    Turn,
    WeightApplied,
    decode,
    pack_logprobs,
    pack_tokens,
)
from squall.trainer.backend import make_backend
from squall.trainer.filters import decide_group
from squall.trainer.group_assembly import GroupAssembler
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
                                      max_staleness=cfg.max_sample_age, overlong=cfg.overlong,
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
    parser.add_argument(
        "--publish", action="store_true", help="time weight publication instead (see publication())"
    )
    parser.add_argument("--publish-models", nargs="+", choices=PUBLISH_MODELS, default=list(PUBLISH_MODELS))
    parser.add_argument(
        "--publish-repeats", type=int, default=5, help="rounds, one publication per case each (median)"
    )
    parser.add_argument("--publish-lora-rank", type=int, default=16, help="rank of the LoRA adapter case")
    parser.add_argument(
        "--publish-threads", type=int, default=4, help="shard write threads of the parallel case"
    )
    parser.add_argument(
        "--publish-dir", default=None, help="where versions are written (default: the temp dir)"
    )
    parser.add_argument(
        "--world-sizes", action="store_true", help="time a step at 1 and 2 ranks instead (see world_sizes())"
    )
    parser.add_argument("--rank-models", nargs="+", choices=list(RANK_MODELS), default=list(RANK_MODELS))
    args = parser.parse_args(argv)
    if args.publish:
        return publication(args)
    if args.world_sizes:
        return world_sizes(args)
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


# --- weight publication: publish -> applied, vs model size and layout --------------------------

PUBLISH_MODELS = ("calc-policy", "qwen2-0.5b")


def publish_state(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What TorchBackend.weights() publishes: the full state dict as separate CPU copies."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    del model
    return state


def raw_write_s(folder: Path, nbytes: int) -> float:
    """Seconds to write and fsync `nbytes` as one file: the disk's sequential bandwidth as a
    publication sees it, measured beside it."""
    chunk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    path = folder / "raw-write.bin"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        left = nbytes
        while left > 0:
            left -= handle.write(chunk[: min(left, len(chunk))])
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def start_node(redis_url: str, run: str, model_dir: Path, dtype: str, log: Path) -> subprocess.Popen:
    """`squall inference` in its own process (its own GIL), following `weights`."""
    from squall.shared.localredis import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "SQUALL_RUN__LOG_LEVEL": "WARNING",
           "SQUALL_INFERENCE__DTYPE": dtype, "SQUALL_INFERENCE__TORCH_THREADS": "1"}  # fmt: skip
    command = [sys.executable, "-m", "squall.cli", "inference", "--run", run, "--redis-url", redis_url,
               "--model", str(model_dir), "--port", str(free_port()), "--node", "bench"]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115


def wait_node(r, keys: Keys, node: subprocess.Popen, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while not r.hexists(keys.heartbeats, "inference:bench"):
        if node.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the inference node did not start (exit {node.poll()}); see its log")
        time.sleep(0.2)


def wait_applied(r, keys: Keys, version: int, after: str, deadline_s: float) -> tuple[WeightApplied, str]:
    """The node's WeightApplied for `version` on `weights:applied` (entries after `after`)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for _, entries in r.xread({keys.weights_applied: after}, block=500) or []:
            for entry_id, fields in entries:
                after = entry_id.decode()
                applied = decode(fields[ENTRY_FIELD], WeightApplied)
                if applied.version == version:
                    return applied, after
    raise TimeoutError(f"no inference node applied version {version} within {deadline_s:.0f}s")


def adapter_of(model_dir: Path, dtype: torch.dtype, rank: int) -> tuple[dict, dict]:
    """A LoRA adapter as the trainer publishes one (trainer/lora.py, default target modules):
    (its tensors, its adapter_config.json), lora_B randomised so applying it changes the model."""
    from transformers import AutoModelForCausalLM

    from squall.shared.config import TrainerSection
    from squall.trainer import lora

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    peft_model = lora.wrap(model, TrainerSection(lora_rank=rank), str(model_dir))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    return lora.adapter_weights(peft_model), lora.adapter_config(peft_model)


def time_lora(r, keys: Keys, run_dir: Path, adapter: tuple[dict, dict], repeats: int) -> dict:
    """LoRA versions published on a node still serving its base model (a node that loaded full
    weights refuses adapters): the same timings as time_publications."""
    from squall.shared.adapterfiles import FORMAT_LORA
    from squall.trainer.publish import Publisher

    tensors, config = adapter
    publisher = Publisher(r, keys, run_dir, keep_versions=2, adapter_config=config)
    runs = []
    for version in range(1, repeats + 1):
        os.sync()
        start = time.time()
        publisher.publish(version, version, tensors)
        published = time.time()
        applied, _ = wait_applied(r, keys, version, "0-0", 600)
        runs.append((published - start, applied.load_s, applied.applied_at - start))
        publisher.prune()
    write_s, load_s, total_s = (float(np.median(x)) for x in zip(*runs, strict=True))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"format": FORMAT_LORA, "write_threads": 1, "publish_s": round(write_s, 3), "node_load_s": round(load_s, 3),
            "publish_to_applied_s": round(total_s, 3), "bytes": nbytes, "rank": config["r"],
            "publish_s_all": [round(x[0], 2) for x in runs]}  # fmt: skip


def time_publications(r, keys: Keys, run_dir: Path, state: dict, cases: list[tuple[str, int]],
                      repeats: int, first_version: int = 0) -> dict:  # fmt: skip
    """`repeats` rounds; each round publishes once per (format, write threads) case and writes
    as many raw bytes, in turn, so the shared disk's swings hit every case alike; dirty pages
    are flushed (sync) before each. Per case: the median of the trainer's publish (write +
    fsync + checksum + announce), the node's load, and publish -> applied."""
    from squall.trainer.publish import Publisher

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    publishers = [Publisher(r, keys, run_dir, keep_versions=2, weights_format=weights_format,
                            write_threads=threads) for weights_format, threads in cases]  # fmt: skip
    runs: list[list[tuple[float, float, float]]] = [[] for _ in cases]
    raw: list[float] = []
    version, after = first_version, "0-0"
    for _ in range(repeats):
        for case, publisher in enumerate(publishers):
            version += 1
            os.sync()
            start = time.time()
            publisher.publish(version, version, state)
            published = time.time()
            applied, after = wait_applied(r, keys, version, after, 600)
            runs[case].append((published - start, applied.load_s, applied.applied_at - start))
            publisher.prune()
        os.sync()
        raw.append(raw_write_s(run_dir, nbytes))
    rows = []
    for (weights_format, threads), case_runs in zip(cases, runs, strict=True):
        write_s, load_s, total_s = (float(np.median(x)) for x in zip(*case_runs, strict=True))
        rows.append({"format": weights_format, "write_threads": threads, "publish_s": round(write_s, 3),
                     "node_load_s": round(load_s, 3), "publish_to_applied_s": round(total_s, 3),
                     "publish_MB_per_s": round(nbytes / write_s / 1e6, 1),
                     "publish_s_all": [round(x[0], 2) for x in case_runs]})  # fmt: skip
    raw_s = float(np.median(raw))
    return {"bytes": nbytes, "raw_write_fsync_s": round(raw_s, 3), "raw_write_MB_per_s": round(nbytes / raw_s / 1e6, 1),
            "raw_write_fsync_s_all": [round(x, 2) for x in raw], "cases": rows}  # fmt: skip


def publication(args: argparse.Namespace) -> int:
    """Publish -> applied for the calc policy (fp32, ~1M parameters) and a random Qwen2-0.5B-shaped
    model (published in bf16, served in bf16): LoRA adapter, sharded and single file, beside the
    disk's raw write + fsync of the same bytes, measured in the same run."""
    results = {}
    with tempfile.TemporaryDirectory(dir=args.publish_dir) as tmp:
        server = LocalRedis(data_dir=Path(tmp) / "redis").start()
        try:
            for name in args.publish_models:
                results[name] = measure_model(server.url, Path(tmp), name, args)
        finally:
            server.close()
    print(json.dumps({"publication": results, "cpu_count": os.cpu_count()}, indent=2))
    return 0


def measure_model(redis_url: str, tmp: Path, name: str, args: argparse.Namespace) -> dict:
    """One model's publications, against one inference node in its own process: LoRA versions
    first (the node still serves its base), then the full-weight rounds."""
    import redis

    from squall.inference.tiny import build_shaped_model
    from squall.shared.weightfiles import FORMAT_FILE, FORMAT_SHARDED

    r = redis.Redis.from_url(redis_url)
    if name == "calc-policy":
        model_dir, dtype = Path(__file__).resolve().parent.parent / "examples/calc/policy", "float32"
    else:
        model_dir, dtype = build_shaped_model(tmp / name, name), "bfloat16"
    adapter = adapter_of(model_dir, getattr(torch, dtype), args.publish_lora_rank)
    state = publish_state(model_dir, getattr(torch, dtype))
    keys = Keys(f"bench-{name.replace('.', '-')}")
    node = start_node(redis_url, keys.run, model_dir, dtype, tmp / f"{name}.log")
    try:
        wait_node(r, keys, node, 600)
        lora_row = time_lora(r, keys, tmp / f"run-{name}", adapter, args.publish_repeats)
        cases = [(FORMAT_SHARDED, args.publish_threads), (FORMAT_SHARDED, 1), (FORMAT_FILE, 1)]
        timed = time_publications(r, keys, tmp / f"run-{name}", state, cases, args.publish_repeats,
                                  first_version=args.publish_repeats)  # fmt: skip
    finally:
        node.terminate()
        node.wait(30)
    parameters = sum(t.numel() for k, t in state.items() if k != "lm_head.weight")
    return {"parameters": parameters, "dtype": dtype, **timed, "lora": lora_row}


# --- world sizes: one optimizer step at 1 and 2 ranks (FSDP over gloo) on CPU ----------------

RANK_MODELS = {"tiny": {"hidden_size": 64, "num_layers": 2}, "small": {"hidden_size": 256, "num_layers": 4}}


def rank_config(model_path: Path, run_dir: Path, groups_per_step: int):
    return load_config(env={}, overrides={
        "run": {"name": "bench", "dir": str(run_dir)}, "model": {"path": str(model_path)},
        "trainer": {"groups_per_step": groups_per_step, "device": "cpu", "max_seq_len": 100_000,
                    "max_tokens_per_microbatch": 2048},
    })  # fmt: skip


def rank_steps(args: argparse.Namespace, vocab: int) -> list[list]:
    """`--steps` + 1 steps' samples (the first is a warm-up), advantages +-1."""
    trajectories = make_trajectories("bench", args.groups_per_step * (args.steps + 1), args.group_size, args.turns,
                                     args.prompt, args.response, args.obs, vocab, 0)  # fmt: skip
    per_step = args.groups_per_step * args.group_size
    return [
        [
            s
            for i, t in enumerate(trajectories[k : k + per_step])
            for s in trajectory_to_samples(t, advantage=1.0 if i % 2 else -1.0)
        ]  # fmt: skip
        for k in range(0, len(trajectories), per_step)
    ]


def floor_steps(args: argparse.Namespace) -> list[list]:
    """Steps of 2 trajectories of 8 tokens: almost no compute, so what a step at 2 ranks costs
    beyond 1 rank is the distributed floor (all-gathers, reduce-scatter, broadcasts, reduces)."""
    trajectories = make_trajectories("floor", args.steps + 1, 2, 1, 4, 4, 0, 512, 1)
    return [
        [
            s
            for i, t in enumerate(trajectories[k : k + 2])
            for s in trajectory_to_samples(t, advantage=1.0 - 2 * i)
        ]
        for k in range(0, len(trajectories), 2)
    ]


def timed_steps(backend, steps: list[list]) -> tuple[list[float], float]:
    """Seconds of each step after the warm-up one, and the trained tokens per step."""
    import torch.distributed as dist

    backend.train_step(steps[0])
    times = []
    for samples in steps[1:]:
        if dist.is_initialized():
            dist.barrier()  # every rank starts the step together: the time is the slowest rank's
        start = time.perf_counter()
        metrics = backend.train_step(samples)
        times.append(time.perf_counter() - start)
    return times, metrics["tokens"]


def rank_worker(rank: int, world_size: int, port: int, model_path: str, run_dir: str, steps: dict[str, list],
                groups_per_step: int, out: str) -> None:  # fmt: skip
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    from squall.trainer import distributed

    distributed.init_world("cpu", 300)
    try:
        backend = make_backend("torch", rank_config(Path(model_path), Path(run_dir), groups_per_step))
        measured = {name: timed_steps(backend, batches) for name, batches in steps.items()}
        if rank == 0:
            Path(out).write_text(json.dumps(measured))
    finally:
        distributed.shutdown()


def world_size_case(model_path: Path, tmp: Path, steps: dict[str, list], args: argparse.Namespace,
                    world_size: int, threads: int) -> dict:  # fmt: skip
    """Median step time and trained tokens/s of one case, and its step time on the floor batch."""
    if world_size == 1:
        torch.set_num_threads(threads)
        backend = make_backend("torch", rank_config(model_path, tmp / "run1", args.groups_per_step))
        measured = {name: timed_steps(backend, batches) for name, batches in steps.items()}
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = tmp / f"ws{world_size}.json"
        mp.spawn(rank_worker, args=(world_size, port, str(model_path), str(tmp / f"run{world_size}"), steps,
                                    args.groups_per_step, str(out)), nprocs=world_size)  # fmt: skip
        measured = json.loads(out.read_text())
    times, tokens = measured["full"]
    step_s = float(np.median(times))
    return {"world_size": world_size, "threads_per_rank": threads, "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens / step_s, 1), "floor_step_s": round(float(np.median(measured["floor"][0])), 4)}  # fmt: skip


def world_sizes(args: argparse.Namespace) -> int:
    """Step time and tokens/s at 1 rank (1 and 2 threads) and 2 ranks (1 thread each) for each
    model, in one run. Same cores either way: two ranks can only win what one process with one
    thread leaves idle, and pay the all-gathers and reduce-scatters of every layer."""
    from squall.inference.tiny import build_tiny_model

    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in args.rank_models:
            model_path = build_tiny_model(tmp / name, **RANK_MODELS[name])
            steps = {"full": rank_steps(args, vocab=512), "floor": floor_steps(args)}
            cases = [world_size_case(model_path, tmp, steps, args, ws, threads)
                     for ws, threads in ((1, 1), (1, 2), (2, 1))]  # fmt: skip
            one = cases[0]["step_s"]
            for case in cases:
                case["model"] = f"{name} (hidden {RANK_MODELS[name]['hidden_size']}, " \
                                f"{RANK_MODELS[name]['num_layers']} layers)"  # fmt: skip
            two = cases[2]
            # what two ranks cost beyond half the one-rank step: communication and the FSDP overhead
            two["overhead_vs_half_of_1_rank_s"] = round(two["step_s"] - one / 2, 4)
            two["speedup_vs_1_rank_1_thread"] = round(one / two["step_s"], 2)
            # the same on an 8-token batch: the per-step cost of being distributed, nearly without compute
            two["floor_overhead_s"] = round(two["floor_step_s"] - cases[0]["floor_step_s"], 4)
            results += cases
    print(json.dumps({"trajectories_per_step": args.groups_per_step * args.group_size,
                      "tokens_per_step": sum(s.length for s in steps["full"][1]), "cpu_cores": os.cpu_count(),
                      "cases": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
