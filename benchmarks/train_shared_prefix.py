"""The trainer's shared prompt (trainer.share_prefix) on and off, same run: one LoRA step on a
calc_real group with the run file's settings.

    .venv/bin/python benchmarks/train_shared_prefix.py                 # SmolLM2-135M-Instruct, CPU
    .venv/bin/python benchmarks/train_shared_prefix.py --device cuda --groups 4 --rounds 5

A group is --size attempts at one calc_real question: the prompt is the agent's real one (tools
block, worked exchange, the question) rendered by the run's chat template; each attempt's own
part (the answer's turns and the tool result between them) is random tokens of the lengths the
race's groups had, 40 to 90, so no two attempts share anything past the prompt. Token values do
not change the compute. Rounds alternate off/on, each on a fresh backend (same seed, so the
same step); medians of the step's wall seconds are printed, with the tokens the model ran and
the difference between the last round's two steps' loss and gradient norm.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.calc_real.agent import DEMONSTRATION, TOOLS  # noqa: E402
from squall.inference.prompt import ChatFormat  # noqa: E402
from squall.shared.config import RunConfig, load_config  # noqa: E402
from squall.trainer.backend import make_backend  # noqa: E402
from squall.trainer.prefix_sharing import plan_microbatches  # noqa: E402
from squall.trainer.sequences import Sample  # noqa: E402

RUN_FILE = ROOT / "examples" / "calc_real" / "real.toml"


def group_samples(tokenizer, cfg: RunConfig, groups: int, size: int, rng: random.Random) -> list[Sample]:
    chat = ChatFormat(tokenizer, cfg.inference.tool_parser, str(ROOT / cfg.inference.chat_template))
    out = []
    for g in range(groups):
        question = f"What is {rng.randint(12, 99)} * {rng.randint(12, 99)}?"
        text = chat.render([*DEMONSTRATION, {"role": "user", "content": question}], TOOLS)
        prompt = np.array(tokenizer(text, add_special_tokens=False).input_ids, np.int32)
        for i in range(size):
            own = np.array([rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(40, 90))], np.int32)
            ids = np.concatenate([prompt, own])
            mask = np.zeros(ids.shape[0], np.float32)
            mask[len(prompt) :] = 1
            behaviour = np.where(mask > 0, -3.0, 0.0).astype(np.float32)
            out.append(Sample(f"g{g}:{i}#0", f"g{g}", ids, mask, behaviour, 1.0 if i % 2 else -1.0))
    return out


def step(model: Path, device: str, samples: list[Sample], share: bool) -> tuple[float, dict]:
    cfg = load_config(
        RUN_FILE,
        env={},
        overrides={
            "run": {"dir": tempfile.mkdtemp(prefix="squall-prefix-")},
            "model": {"path": str(model)},
            "trainer": {"device": device, "share_prefix": share},
        },
    )
    backend = make_backend("torch", cfg)
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    metrics = backend.train_step(samples)
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, metrics


def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    cfg = load_config(RUN_FILE, env={})
    samples = group_samples(
        AutoTokenizer.from_pretrained(args.model), cfg, args.groups, args.size, random.Random(0)
    )
    budget = cfg.trainer.max_tokens_per_microbatch
    ran = {}
    for share in (False, True):
        plan = plan_microbatches(samples, budget, share=share)
        ran[share] = sum(mb.prefix + sum(samples[i].length - mb.prefix for i in mb.indices) for mb in plan)
    step(args.model, args.device, samples[: args.size], True)  # warm-up: allocator, kernels
    times: dict[bool, list[float]] = {False: [], True: []}
    metrics: dict[bool, dict] = {}
    for _ in range(args.rounds):
        for share in (False, True):
            seconds, metrics[share] = step(args.model, args.device, samples, share)
            times[share].append(seconds)
    prompt = int(np.flatnonzero(samples[0].loss_mask)[0])
    print(
        f"model {args.model}, device {args.device}, {args.groups} group(s) of {args.size}, "
        f"prompt {prompt} tokens, {sum(s.length for s in samples)} tokens per step, {args.rounds} rounds"
    )
    print("sharing  step_s (median, min-max)   tokens_run  microbatches")
    for share in (False, True):
        t = times[share]
        print(
            f"{'on ' if share else 'off':8} {statistics.median(t):6.2f} ({min(t):.2f}-{max(t):.2f})"
            f"{'':14}{ran[share]:6d}  {int(metrics[share]['microbatches'])}"
        )
    off, on = statistics.median(times[False]), statistics.median(times[True])
    loss_diff = abs(metrics[True]["loss"] - metrics[False]["loss"])
    norm_diff = abs(metrics[True]["grad_norm"] - metrics[False]["grad_norm"])
    print(f"speedup={off / on:.2f} loss_abs_diff={loss_diff:.2e} grad_norm_abs_diff={norm_diff:.2e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "runs/models/smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--groups", type=int, default=1, help="groups per step (the run file has 1)")
    parser.add_argument("--size", type=int, default=8, help="attempts per group (the run file has 8)")
    parser.add_argument("--rounds", type=int, default=3)
    main(parser.parse_args())
