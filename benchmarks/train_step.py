"""One torch-backend optimizer step on a model shape and device: step time, trained tokens/s
and peak memory at several sequence lengths; then the same batch's token logprobs and step
loss on CPU (fp32) beside the device (bf16 autocast), to show the two agree within bf16.

Shapes are built offline, randomly initialised (no hub): `tiny` is the demo policy's shape,
`qwen2-0.5b` the Qwen2-0.5B architecture (896 hidden, 24 layers, 14/2 heads, 151,936 vocab).

    python benchmarks/train_step.py --shape qwen2-0.5b --device cuda --seq 512,1024,2048,4096
    .venv/bin/python benchmarks/train_step.py --shape tiny --device cpu --seq 128,256
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from squall.inference.tiny import MODEL_SHAPES, build_shaped_model, build_tiny_model
from squall.shared.config import load_config
from squall.trainer.sequences import Sample
from squall.trainer.torch_backend import TorchBackend

SHAPES = ("tiny", *MODEL_SHAPES)


def build_model(shape: str, out: Path) -> Path:
    if shape == "tiny":
        return build_tiny_model(out, hidden_size=128, num_layers=4)  # the demo policy's shape
    return build_shaped_model(out, shape)


def make_samples(vocab: int, length: int, count: int, seed: int = 0) -> list[Sample]:
    """`count` sequences of `length` tokens; the second half is the trained response."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        ids = rng.integers(3, vocab, size=length).astype(np.int32)
        mask = np.zeros(length, np.float32)
        mask[length // 2 :] = 1
        behaviour = np.where(mask > 0, -np.log(vocab), 0).astype(np.float32)  # uniform sampler
        out.append(Sample(f"t{i}#0", f"g{i // 8}", ids, mask, behaviour, 1.0 if i % 2 else -1.0))
    return out


def backend(
    model_dir: Path, device: str, microbatch_tokens: int, *, lora_rank: int = 0, run_dir: str | None = None
) -> TorchBackend:
    config = load_config(env={}, overrides={
        "run": {"name": "bench", "dir": run_dir or tempfile.mkdtemp(prefix="squall-step-")},
        "model": {"path": str(model_dir)},
        "trainer": {"device": device, "max_tokens_per_microbatch": microbatch_tokens, "max_seq_len": 1 << 20,
                    "lora_rank": lora_rank},
    })  # fmt: skip
    return TorchBackend(config)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(
    model: TorchBackend, length: int, tokens_per_step: int, repeats: int, baseline: int = 0
) -> dict:
    """Median step time after a warm-up; peak device memory above `baseline` bytes (what was
    allocated before the backend, e.g. an inference engine's model)."""
    count = max(1, tokens_per_step // length)
    samples = make_samples(model.vocab_size, length, count)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train_step(samples)  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        sync(model.device)
        start = time.perf_counter()
        metrics = model.train_step(samples)
        sync(model.device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    peak = (
        (torch.cuda.max_memory_allocated() - baseline) / 2**30
        if model.device.type == "cuda"
        else float("nan")
    )
    return {
        "seq_len": length, "sequences": count, "tokens": count * length, "step_s": round(step_s, 4),
        "tokens_per_s": round(count * length / step_s), "trained_tokens": int(metrics["tokens"]),
        "microbatches": int(metrics["microbatches"]), "peak_gib": round(peak, 2),
    }  # fmt: skip


def agreement(model_dir: Path, device: str, length: int) -> dict:
    """Token logprobs and the step loss of one batch on CPU fp32 vs `device`."""
    from squall.trainer.losses import token_logprobs
    from squall.trainer.sequences import collate, token_weights

    cpu, dev = backend(model_dir, "cpu", 1 << 20), backend(model_dir, device, 1 << 20)
    samples = make_samples(cpu.vocab_size, length, 4, seed=1)
    arrays = collate(samples, token_weights(samples, "token"), cpu.pad_id)
    with torch.no_grad():
        logps = []
        for model in (cpu, dev):
            targets = torch.from_numpy(arrays["targets"]).to(model.device)
            logps.append(token_logprobs(model._forward(model.model, arrays).float(), targets).cpu())
    mask = torch.from_numpy(arrays["loss_mask"]) > 0
    gap = (logps[0] - logps[1]).abs()[mask]
    cpu_loss, dev_loss = cpu.train_step(samples)["loss"], dev.train_step(samples)["loss"]
    return {
        "seq_len": length, "logprob_mean_abs_diff": round(float(gap.mean()), 5),
        "logprob_max_abs_diff": round(float(gap.max()), 5), "loss_cpu": round(cpu_loss, 6),
        "loss_device": round(dev_loss, 6), "loss_abs_diff": round(abs(cpu_loss - dev_loss), 6),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq", default="128,256", help="comma-separated sequence lengths")
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--microbatch-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--agreement-seq", type=int, default=256, help="0: skip the CPU vs device check")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.shape, Path(tmp) / args.shape)
        model = backend(model_dir, args.device, args.microbatch_tokens)
        params = sum(p.numel() for p in model.model.parameters())
        print(f"{args.shape}: {params / 1e6:.1f}M parameters, device {args.device}"
              f" ({torch.cuda.get_device_name() if model.device.type == 'cuda' else 'cpu'})", flush=True)  # fmt: skip
        rows = []
        for length in (int(v) for v in args.seq.split(",")):
            rows.append(time_steps(model, length, args.tokens_per_step, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
        del model
        check = (
            agreement(model_dir, args.device, args.agreement_seq)
            if args.agreement_seq and args.device != "cpu"
            else None
        )
    print("\nseq len | sequences | step s | tokens/s | peak GiB")
    for row in rows:
        print(
            f"{row['seq_len']:7d} | {row['sequences']:9d} | {row['step_s']:6.3f} | {row['tokens_per_s']:8d} | {row['peak_gib']}"
        )
    if check:
        print("CPU fp32 vs device bf16:", json.dumps(check))
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": rows, "agreement": check}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
