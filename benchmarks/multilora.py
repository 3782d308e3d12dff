"""Mixed-adapter serving (issue 22): one torch engine batch holding requests for 1, 2 and 4
LoRA adapters, beside the base model alone, in the same run; then per-role publish -> applied.

    .venv/bin/python benchmarks/multilora.py                        # SmolLM2-135M in runs/models
    .venv/bin/python benchmarks/multilora.py --model DIR --rounds 3 --tokens 32 --batch 8

Throughput: two engines in this process on the same model, both with one torch thread:
`base` serves the plain model (what a single-policy node serves: a merged adapter is a plain
forward too); `mixed` serves the pristine base with K adapters (rank --rank on every
projection the trainer adapts by default) in its bank, the batch's --batch requests spread
round-robin over the K adapters. Each request samples exactly --tokens tokens (ignore_eos).
The conditions alternate in rounds (the machine may be shared) and medians are reported, with
tokens per CPU second beside wall tokens/s. Goal: mixed with 4 adapters >= 0.7x the base.

--peft: the same forward-level comparison against peft's own mixed-adapter batches (the model
wrapped in a PeftModel holding the 4 adapters, `adapter_names=` per row in every forward):
a prefill of the batch, then --tokens decode steps through the KV cache, for the plain model,
the AdapterBank and peft, with the rows spread over 4 adapters (median of --rounds).

publish -> applied: a WeightFollower on a private Redis follows the run while the adapters of
--roles roles are written as the trainer writes them (publish.write_adapter) and announced;
the time from each XADD on `weights` until the role's `weights:applied` entry.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [{"role": "user", "content": "Tom has 12 apples and gets 7 more. How many apples does Tom have?"}]


def write_random_adapter(model: Any, folder: Path, rank: int, seed: int, version: int) -> str:
    """A random rank-`rank` adapter on every TARGETS layer, in the trainer's layout; its checksum."""
    from squall.trainer.publish import write_adapter

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.endswith(TARGETS) and isinstance(module, torch.nn.Linear):
            out_f, in_f = module.weight.shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "bias": "none", "use_rslora": False, "use_dora": False}  # fmt: skip
    return write_adapter(folder, tensors, config, version=version)


def new_engine(model_dir: str, batch: int) -> Any:
    from squall.inference.engines.torch_engine import TorchEngine
    from squall.shared.config import load_config

    section = {"device": "cpu", "dtype": "float32", "max_batch": batch, "follow_weights": False}
    return TorchEngine(model_dir, load_config(env={}, overrides={"inference": section}).inference)


async def one_batch(engine: Any, prompt_ids: list[int], models: list[tuple[str, int | None]], tokens: int):
    """(tokens per wall second, per CPU second) of one batch: one request per entry of `models`."""
    from squall.inference.engines.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    async def request(role: str, version: int | None) -> int:
        stream = engine.generate(prompt_ids, params, stream=False, role=role, version=version)
        return sum([len(d.token_ids) async for d in stream])

    wall, cpu = time.perf_counter(), time.process_time()
    produced = sum(await asyncio.gather(*(request(role, v) for role, v in models)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return produced / wall, produced / cpu


async def throughput(args: argparse.Namespace, folders: list[Path]) -> dict[str, list[tuple[float, float]]]:
    base, mixed = new_engine(args.model, args.batch), new_engine(args.model, args.batch)
    await base.start()
    await mixed.start()
    try:
        for i, folder in enumerate(folders):
            await mixed.apply_adapter(1, str(folder), f"role{i}")
        text = base.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
        prompt_ids = base.tokenizer.encode(text, add_special_tokens=False)
        conditions: dict[str, tuple[Any, list[tuple[str, int | None]]]] = {
            "base alone": (base, [("policy", None)] * args.batch)
        }
        for k in (1, 2, 4):
            rows = [(f"role{i % k}", None) for i in range(args.batch)]
            conditions[f"{k} adapter{'s' if k > 1 else ''}"] = (mixed, rows)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in conditions}
        for engine, rows in conditions.values():  # warm-up
            await one_batch(engine, prompt_ids, rows, 4)
        for round_ in range(args.rounds):
            for name, (engine, rows) in conditions.items():
                results[name].append(await one_batch(engine, prompt_ids, rows, args.tokens))
            print(
                f"round {round_ + 1}: " + ", ".join(f"{n} {r[-1][0]:.1f}" for n, r in results.items()),
                flush=True,
            )
        return results
    finally:
        await base.stop()
        await mixed.stop()


async def publish_to_applied(args: argparse.Namespace, tmp: Path, reference: Any) -> dict[str, list[float]]:
    """Seconds from announcing each role's adapter until the node's weights:applied entry for it."""
    import redis.asyncio as aioredis

    from squall.inference.node_metrics import InferenceMetrics
    from squall.inference.weights.reload import WeightFollower
    from squall.shared import bus, schemas
    from squall.shared.keys import Keys
    from squall.shared.localredis import free_port
    from squall.shared.redisconn import connect
    from squall.shared.retry import RedisOutage

    url = f"redis://127.0.0.1:{free_port()}/0"
    r = connect(url, autostart=True)
    keys = Keys("benchmultilora")
    engine = new_engine(args.model, args.batch)
    await engine.start()
    client = aioredis.from_url(url)
    follower = WeightFollower(
        client, keys, engine, node="bench", metrics=InferenceMetrics(), outage=RedisOutage(url, 30.0)
    )
    await follower.catch_up()
    task = asyncio.create_task(follower.run())
    times: dict[str, list[float]] = {}
    try:
        for version in range(1, args.versions + 1):
            for i in range(args.roles):
                role = f"role{i}"
                folder = tmp / "publish" / role / f"v{version:06d}"
                checksum = write_random_adapter(reference, folder, args.rank, 100 * version + i, version)
                message = schemas.WeightVersion(
                    run=keys.run, version=version, step=version, location=str(folder), checksum=checksum,
                    format="lora", role=role,
                )  # fmt: skip
                last = (await client.xrevrange(keys.weights_applied, count=1) or [(b"0-0", {})])[0][0]
                sent = time.perf_counter()
                bus.publish(r, keys.weights, message)
                while True:
                    reply = await client.xread({keys.weights_applied: last}, block=5000)
                    entries = reply[0][1] if reply else []
                    done = False
                    for entry_id, fields in entries:
                        last = entry_id
                        applied = schemas.decode(fields[schemas.ENTRY_FIELD], schemas.WeightApplied)
                        done |= applied.role == role and applied.version == version
                    if done:
                        break
                    if time.perf_counter() - sent > 120:
                        raise TimeoutError(f"{role} v{version} not applied within 120 s")
                times.setdefault(role, []).append(time.perf_counter() - sent)
        return times
    finally:
        follower.stop()
        await asyncio.wait_for(task, 10)
        await engine.stop()
        await client.aclose()


@torch.inference_mode()
def decode_steps(model: Any, ids: torch.Tensor, steps: int, **extra: Any) -> float:
    """Seconds for a prefill of `ids` and `steps` greedy decode steps through the KV cache."""
    from squall.shared.transformers_compat import cache_arg, returned_cache

    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, **extra)
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=token, use_cache=True, **cache_arg(model, returned_cache(out)), **extra)
    return time.perf_counter() - start


def against_peft(args: argparse.Namespace, folders: list[Path], reference: Any) -> None:
    """Forward-level: the plain model, the AdapterBank and peft's adapter_names batches."""
    import copy

    from peft import PeftModel

    from squall.inference.weights.multilora import AdapterBank, load_adapter

    shared = {id(t): t for t in [*reference.parameters(), *reference.buffers()]}
    banked = copy.deepcopy(reference, memo=shared).eval()
    bank = AdapterBank(banked, slots=len(folders) + 1)
    slots = [bank.put(load_adapter(reference, f, torch.float32, "cpu")) for f in folders]
    bank.rows = torch.tensor([slots[i % len(slots)] for i in range(args.batch)])
    wrapped = PeftModel.from_pretrained(
        copy.deepcopy(reference), str(folders[0]), adapter_name="role0"
    ).eval()
    for i, folder in enumerate(folders[1:], start=1):
        wrapped.load_adapter(str(folder), adapter_name=f"role{i}")
    names = [f"role{i % len(folders)}" for i in range(args.batch)]
    ids = torch.randint(
        0, reference.config.vocab_size, (args.batch, 48), generator=torch.Generator().manual_seed(0)
    )
    runs: dict[str, tuple[Any, dict]] = {
        "plain model": (reference, {}),
        "AdapterBank, 4 adapters": (banked, {}),
        "peft adapter_names, 4 adapters": (wrapped, {"adapter_names": names}),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, extra) in runs.items():
            times[name].append(decode_steps(model, ids, args.tokens, **extra))
    base_s = statistics.median(times["plain model"])
    print(
        f"\nforward level: batch {args.batch}, 48-token prefill + {args.tokens} decode steps, median of {args.rounds}"
    )
    print("| model | seconds | tokens/s | vs plain |\n|---|---|---|---|")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {name} | {median:.2f} | {args.batch * args.tokens / median:.1f} | {base_s / median:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="runs/models/smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=8, help="requests in one batch")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each request samples")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--roles", type=int, default=2, help="roles published in the publish -> applied part")
    parser.add_argument("--versions", type=int, default=3, help="versions per role published there")
    parser.add_argument("--peft", action="store_true", help="also the forward-level comparison with peft")
    parser.add_argument("--only-peft", action="store_true", help="only that comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        folders = []
        for i in range(4):
            write_random_adapter(reference, tmp / f"role{i}", args.rank, seed=i, version=1)
            folders.append(tmp / f"role{i}")
        if args.peft or args.only_peft:
            against_peft(args, folders, reference)
            if args.only_peft:
                return
        results = asyncio.run(throughput(args, folders))
        print(f"\nmodel {args.model}, batch {args.batch}, {args.tokens} tokens/request, rank {args.rank} on "
              f"{len(TARGETS)} projections, 1 torch thread, median of {args.rounds} rounds")  # fmt: skip
        base_tps = statistics.median(t for t, _ in results["base alone"])
        print("| batch holds | tokens/s | tokens/CPU-s | vs base |\n|---|---|---|---|")
        for name, rows in results.items():
            tps, cps = statistics.median(t for t, _ in rows), statistics.median(c for _, c in rows)
            print(f"| {name} | {tps:.1f} | {cps:.1f} | {tps / base_tps:.2f}x |")
        times = asyncio.run(publish_to_applied(args, tmp, reference))
        print("\n| role | publish -> applied, s (median, max over versions) |\n|---|---|")
        for role, seconds in times.items():
            print(f"| {role} | {statistics.median(seconds):.3f}, {max(seconds):.3f} |")


if __name__ == "__main__":
    main()
