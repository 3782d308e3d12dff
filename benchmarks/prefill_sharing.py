"""Shared prefill in the torch engine: the calc_real prompts with sharing on and off, same run.

    .venv/bin/python benchmarks/prefill_sharing.py                       # SmolLM2-135M-Instruct, CPU
    .venv/bin/python benchmarks/prefill_sharing.py --model DIR --rounds 3

Two admissions the calc_real run makes all the time, each sent to the engine (no HTTP) at once,
one token sampled per request, so the time is the prefill:
- group: a GRPO group's first turns, 8 identical prompts (tools block, worked exchange, question);
- val: a validation round's first turns, 32 different questions behind the same opening.
With sharing on, identical prompts take one row and the common opening is computed once (and
kept for the next admission); off, every request prefills its whole prompt, as before. Rounds
alternate on/off and medians are printed: wall seconds and CPU seconds of this process (the
engine thread's work; other people's load on a shared machine moves the first, barely the
second), plus the prompt tokens the model actually ran.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.calc_real.agent import DEMONSTRATION, TOOLS  # noqa: E402
from squall.inference.engines.engine import SamplingParams  # noqa: E402
from squall.inference.engines.torch_engine import TorchEngine  # noqa: E402
from squall.inference.prompt import ChatFormat  # noqa: E402
from squall.shared.config import InferenceSection  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "calc_real" / "chat_template.jinja"


def prompts(engine: TorchEngine, n: int, same: bool, rng: random.Random) -> list[list[int]]:
    chat = ChatFormat(engine.tokenizer, "smollm2", str(TEMPLATE))
    questions = [f"What is {rng.randint(12, 99)} * {rng.randint(12, 99)}?" for _ in range(1 if same else n)]
    out = []
    for i in range(n):
        messages = [*DEMONSTRATION, {"role": "user", "content": questions[0 if same else i]}]
        text = chat.render(messages, TOOLS) + chat.parser.forced_prefix("calculator")
        out.append(engine.tokenizer(text, add_special_tokens=False).input_ids)
    return out


async def admit(engine: TorchEngine, batch: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=1, temperature=1.0)

    async def one(ids: list[int]) -> None:
        async for _ in engine.generate(ids, params, stream=False):
            pass

    await asyncio.wait_for(asyncio.gather(*(one(ids) for ids in batch)), 1200)


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    engine = TorchEngine(args.model, InferenceSection(max_batch=64, max_model_len=1024))
    await engine.start()
    rng = random.Random(0)
    cases = {
        "group (8 same)": lambda: prompts(engine, 8, True, rng),
        "val (32 differ)": lambda: prompts(engine, 32, False, rng),
    }
    results: dict[tuple[str, bool], list[tuple[float, float, int]]] = {}
    try:
        for _ in range(args.rounds):
            for name, make in cases.items():
                batch = make()
                for share in (False, True):
                    engine.share_prefill = share
                    engine._prefix = ((), [])  # a cold start each time: no opening kept from before
                    tokens0 = engine.stats()["prefill_tokens"]
                    wall, cpu = time.perf_counter(), time.process_time()
                    await admit(engine, batch)
                    results.setdefault((name, share), []).append(
                        (
                            time.perf_counter() - wall,
                            time.process_time() - cpu,
                            engine.stats()["prefill_tokens"] - tokens0,
                        )
                    )
    finally:
        await engine.stop()
    print(
        f"model {args.model}, {args.rounds} round(s), medians; prompt ~{len(prompts(engine, 1, True, rng)[0])} tokens"
    )
    print("case              sharing  wall_s   cpu_s  prompt_tokens_run")
    for (name, share), rows in results.items():
        wall = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows)
        print(f"{name:17} {'on ' if share else 'off':8} {wall:7.2f} {cpu:7.2f}  {rows[0][2]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/models/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
