"""Full weights vs LoRA, in one run on one device: the trainer's step (time, tokens/s, peak
memory, trained parameters), what a version costs to publish (bytes, write + checksum), and
to apply on a torch inference engine (checksum verified, loaded or merged, swapped in), beside
the disk's raw write + fsync of the full version's bytes.

publish -> applied here = the trainer's write (Publisher.write: files, fsync, checksum) + the
node's verification (WeightFollower._verify) + Engine.apply_weights / apply_adapter (load or
merge into a copy, swap between requests), all in this process; the Redis round trip it
leaves out is a few milliseconds (benchmarks/trainer.py --publish has the full path).

    python benchmarks/lora.py --shape qwen2-0.5b --device cuda
    .venv/bin/python benchmarks/lora.py --shape tiny --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
import torch
from train_step import SHAPES, backend, build_model, time_steps
from trainer import raw_write_s

from squall.inference.engines.torch_engine import TorchEngine
from squall.inference.weights.reload import WeightFollower
from squall.shared.config import load_config
from squall.shared.keys import Keys
from squall.shared.schemas import WeightVersion
from squall.trainer.publish import Publisher
from squall.trainer.torch_backend import TorchBackend


def publish_and_apply(publisher: Publisher, engine: TorchEngine, version: int, state: dict) -> dict:
    """One version written, verified and applied; seconds of each part and the bytes."""
    start = time.perf_counter()
    location, checksum = publisher.write(version, state)
    written = time.perf_counter()
    message = WeightVersion(run="lorabench", version=version, step=version, location=str(location),
                            checksum=checksum, format=publisher.weights_format)  # fmt: skip
    WeightFollower._verify(message)
    verified = time.perf_counter()
    apply = engine.apply_adapter if publisher.adapter_config is not None else engine.apply_weights
    asyncio.run_coroutine_threadsafe(apply(version, str(location)), engine_loop).result()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    applied = time.perf_counter()
    files = [location] if location.is_file() else list(location.iterdir())
    return {"bytes": sum(f.stat().st_size for f in files), "write_s": written - start,
            "verify_s": verified - written, "apply_s": applied - verified, "total_s": applied - start}  # fmt: skip


engine_loop: asyncio.AbstractEventLoop  # the engine's event loop, run in a thread (apply awaits it)


def start_engine(model_dir: Path, device: str) -> TorchEngine:
    import threading

    global engine_loop
    engine_loop = asyncio.new_event_loop()
    threading.Thread(target=engine_loop.run_forever, daemon=True).start()
    section = load_config(env={}, overrides={"inference": {"device": device, "max_model_len": 256}}).inference
    engine = TorchEngine(str(model_dir), section)
    asyncio.run_coroutine_threadsafe(engine.start(), engine_loop).result()
    return engine


@torch.no_grad()
def served_gap(model: TorchBackend, engine: TorchEngine, vocab: int) -> float:
    """Mean |logprob| difference, over a random 64-token probe, between the trainer's model
    (fp32, adapter live) and what the engine serves (its dtype, adapter merged)."""
    ids = torch.from_numpy(np.random.default_rng(1).integers(3, vocab, (1, 64)))
    model.model.eval()
    trainer = torch.log_softmax(model.model(input_ids=ids.to(model.device)).logits.float(), -1).cpu()
    model.model.train()
    served = torch.log_softmax(engine.model(input_ids=ids.to(engine.device)).logits.float(), -1).cpu()
    return round(float((trainer - served).abs().mean()), 5)


def median_rows(rows: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (all attention + MLP projections)")
    parser.add_argument("--seq", type=int, default=512, help="sequence length of the timed steps")
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="steps and publications timed (median)")
    parser.add_argument("--no-steps", action="store_true", help="skip the training steps (publication only)")
    parser.add_argument("--dir", default=None, help="where versions are written (default: a temp dir)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model_dir = build_model(args.shape, Path(tmp) / "model")
        results = {}
        for name, rank in (("full", 0), ("lora", args.rank)):
            engine = start_engine(model_dir, args.device)  # a fresh node per case: LoRA needs its base
            baseline = torch.cuda.memory_allocated() if args.device.startswith("cuda") else 0
            model = backend(model_dir, args.device, 8192, lora_rank=rank, run_dir=str(Path(tmp) / name))
            trained = sum(p.numel() for p in model.model.parameters() if p.requires_grad)
            if args.no_steps:  # publication only (a 0.5B step on a shared 2-core CPU takes minutes)
                step = {"step_s": float("nan"), "tokens_per_s": 0, "peak_gib": float("nan")}
            else:
                step = time_steps(model, args.seq, args.tokens_per_step, args.repeats, baseline)
            step["trained_params"] = trained
            # write() touches no Redis: the client is never connected.
            publisher = Publisher(redis.Redis(), Keys("lorabench"), Path(tmp) / name, keep_versions=2,
                                  adapter_config=model.adapter_config())  # fmt: skip
            state = model.weights()
            rows = [publish_and_apply(publisher, engine, v, state) for v in range(1, args.repeats + 1)]
            gap = served_gap(model, engine, model.vocab_size)
            results[name] = {
                **step,
                **median_rows(rows),
                "bytes": rows[-1]["bytes"],
                "served_vs_trainer": gap,
            }
            asyncio.run_coroutine_threadsafe(engine.stop(), engine_loop).result()
            print(name, json.dumps(results[name]), flush=True)
            del model, state
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        raw = raw_write_s(Path(tmp), results["full"]["bytes"])
    params = results["full"]["trained_params"]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\n{args.shape} ({params / 1e6:.1f}M parameters), {device}, rank {args.rank}, "
          f"{args.tokens_per_step} tokens/step of {args.seq}")  # fmt: skip
    print(
        "case | trained params | step s | tokens/s | peak GiB | version MB | write s | verify s | apply s "
        "| publish->applied s | served vs trainer |logprob|"
    )
    for name, row in results.items():
        print(f"{name} | {row['trained_params']:,} | {row['step_s']:.3f} | {row['tokens_per_s']} | {row['peak_gib']} | "
              f"{row['bytes'] / 1e6:.2f} | {row['write_s']:.3f} | {row['verify_s']:.3f} | {row['apply_s']:.3f} | "
              f"{row['total_s']:.3f} | {row['served_vs_trainer']}")  # fmt: skip
    full_mb = results["full"]["bytes"] / 1e6
    print(f"disk raw write + fsync of {full_mb:.1f} MB: {raw:.3f} s ({full_mb / raw:.0f} MB/s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "raw_write_s": raw}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
