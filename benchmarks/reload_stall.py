"""How long a weight reload makes new requests wait: the torch engine's two swaps side by side
(`inference.swap` = drain, the old behaviour, and overlap), in one run, on the same model.

    .venv/bin/python benchmarks/reload_stall.py                       # the tiny model
    nice -n 10 .venv/bin/python benchmarks/reload_stall.py --model runs/models/smollm2-135m-instruct

Per mode and round: an engine (no HTTP, no Redis: the stall is the engine's) decodes `--long`
generations of `--tokens` tokens (`ignore_eos`), a reload of the model's own weights file
starts (`apply_weights`: load a copy off the engine thread, then swap), and a probe of one token
is sent every `--probe-every` seconds from that moment until the long generations are done.
The *stall* is the slowest probe's latency minus the median probe latency of the same engine
with no reload (measured first, under the same long generations). Reported per mode: the stall
(median over rounds) and the time until a probe is answered by the new version.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Tell me a long story about a lighthouse keeper."  # plain text: the stall does not depend on it


async def one_token(engine, prompt_ids: list[int]) -> tuple[float, int]:
    from squall.inference.engines.engine import SamplingParams

    began = time.monotonic()
    version = -1
    async for delta in engine.generate(
        prompt_ids, SamplingParams(max_tokens=1, temperature=1.0), stream=False
    ):
        version = delta.weight_version
    return time.monotonic() - began, version


async def long_generation(engine, prompt_ids: list[int], tokens: int) -> None:
    from squall.inference.engines.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    async for _ in engine.generate(prompt_ids, params, stream=False):
        pass


async def probe_while(
    engine, prompt_ids, busy: asyncio.Task, every_s: float
) -> list[tuple[float, float, int]]:
    """(sent at, latency, version) of a one-token probe every `every_s` until `busy` is done."""
    probes: list[asyncio.Task] = []
    start = time.monotonic()
    sent: list[float] = []
    while not busy.done():
        sent.append(time.monotonic() - start)
        probes.append(asyncio.create_task(one_token(engine, prompt_ids)))
        await asyncio.sleep(every_s)
    sent.append(time.monotonic() - start)  # one more after: it is answered by the new version
    probes.append(asyncio.create_task(one_token(engine, prompt_ids)))
    results = await asyncio.gather(*probes)
    return [(at, latency, version) for at, (latency, version) in zip(sent, results, strict=True)]


async def measure(model_dir: str, weights: str, swap: str, args: argparse.Namespace) -> dict[str, float]:
    from squall.inference.engines.torch_engine import TorchEngine
    from squall.shared.config import load_config

    section = load_config(
        env={}, overrides={"inference": {"swap": swap, "max_batch": 64, "max_model_len": 2048}}
    ).inference
    engine = TorchEngine(model_dir, section)
    await engine.start()
    prompt_ids = list(engine.tokenizer.encode(PROMPT))
    try:
        await one_token(engine, prompt_ids)  # warm up
        longs = asyncio.gather(*(long_generation(engine, prompt_ids, args.tokens) for _ in range(args.long)))
        busy = asyncio.ensure_future(longs)
        quiet = await probe_while(engine, prompt_ids, busy, args.probe_every)
        baseline = statistics.median(latency for _, latency, _ in quiet)
        print(
            f"{swap}: {len(quiet)} probes without a reload, p50 {baseline:.3f}s", file=sys.stderr, flush=True
        )
        stalls, new_after = [], []
        for version in range(1, args.rounds + 1):
            busy = asyncio.ensure_future(
                asyncio.gather(*(long_generation(engine, prompt_ids, args.tokens) for _ in range(args.long)))
            )
            await asyncio.sleep(args.probe_every * 2)  # the long generations are decoding
            reload = asyncio.ensure_future(engine.apply_weights(version, weights))
            both = asyncio.ensure_future(asyncio.gather(busy, reload))
            probes = await probe_while(engine, prompt_ids, both, args.probe_every)
            stalls.append(max(latency for _, latency, _ in probes) - baseline)
            print(f"{swap}: reload {version}: {len(probes)} probes, slowest {stalls[-1] + baseline:.2f}s",
                  file=sys.stderr, flush=True)  # fmt: skip
            first_new = [at + latency for at, latency, v in probes if v == version]
            new_after.append(min(first_new) if first_new else float("nan"))
        return {
            "baseline_s": baseline,
            "stall_s": statistics.median(stalls),
            "stall_max_s": max(stalls),
            "new_version_after_s": statistics.median(new_after),
        }
    finally:
        await engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF model folder (default: the tiny test model)")
    parser.add_argument("--long", type=int, default=4, help="long generations running at the reload")
    parser.add_argument("--tokens", type=int, default=128, help="tokens of each long generation")
    parser.add_argument("--probe-every", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if not model_dir:
            from squall.inference.tiny import build_tiny_model

            model_dir = str(build_tiny_model(Path(tmp) / "tiny"))
        weights = next(Path(model_dir).glob("*.safetensors"), None)
        if weights is None:
            print(f"reload_stall: no *.safetensors in {model_dir}", file=sys.stderr)
            return 2
        rows = {
            swap: asyncio.run(measure(model_dir, str(weights), swap, args)) for swap in ("drain", "overlap")
        }
    print(f"model {model_dir}: {args.long} generations of {args.tokens} tokens running, "
          f"a probe every {args.probe_every}s, {args.rounds} reload(s) per mode, {args.threads} torch threads")  # fmt: skip
    print(
        f"{'swap':8} {'probe p50 (no reload)':>22} {'stall (median)':>15} {'stall (max)':>12} {'new version after':>18}"
    )
    for swap, row in rows.items():
        print(f"{swap:8} {row['baseline_s']:21.3f}s {row['stall_s']:14.2f}s {row['stall_max_s']:11.2f}s "
              f"{row['new_version_after_s']:17.2f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
