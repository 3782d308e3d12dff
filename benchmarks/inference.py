"""Inference throughput: the squall server at concurrency 1, 8 and 32 beside plain
`model.generate` on the same model, in the same run.

    .venv/bin/python benchmarks/inference.py                 # the tiny model, CPU
    .venv/bin/python benchmarks/inference.py --model DIR --tokens 128
    .venv/bin/python benchmarks/inference.py --engine   # + the engine alone, without HTTP
    python benchmarks/inference.py --device cuda --shape qwen2-0.5b --concurrency 1,8,32,128
    python benchmarks/inference.py --model DIR --backends torch,vllm   # the backends side by side

With --backends, each backend in turn serves the model as `squall inference --backend B`,
following a run on a private Redis: tokens/s and p50/p99 latency at each concurrency, then the
reload time (a full version published on the bus until /health reports it). Run it where both
are installed: `make test-vllm`'s venv.

Every request samples exactly `--tokens` tokens (`ignore_eos`; `min_new_tokens` for
generate), so tokens/s compare like with like. The server runs as `squall inference` in a
subprocess with one torch thread; generate runs here with one torch thread. The two alternate
in rounds and medians are compared (the machine may be shared); beside wall-clock tokens/s,
tokens per CPU second of the serving process (server: read from /proc; generate: this
process) compare the work each does per token, which other people's load barely moves. Targets: server
overhead at concurrency 1 <= 10% (vs generate at batch 1), and aggregate tokens/s at
concurrency 8 >= 3x concurrency 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

PROMPT = [{"role": "user", "content": "Tom has 12 apples and gets 7 more. How many apples does Tom have?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Generate:
    """Plain `model.generate` on the same model and prompt, in this process."""

    def __init__(self, model_dir: str, device: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32  # as the server's "auto"
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        prompt = self.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
        self.prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)

    def run(self, tokens: int, batch: int, repeats: int) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second) sampling `tokens` for `batch` prompts."""
        ids = torch.tensor([self.prompt_ids] * batch, device=self.device)
        kwargs = dict(
            max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_p=1.0, temperature=1.0, top_k=0,
            pad_token_id=self.tokenizer.pad_token_id, attention_mask=torch.ones_like(ids),
        )  # fmt: skip
        with torch.inference_mode():
            self.model.generate(ids, **kwargs)  # warm-up
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(repeats):
                out = self.model.generate(ids, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert out.shape[1] - ids.shape[1] == tokens
        produced = batch * tokens * repeats
        return produced / wall, produced / cpu


async def bench_server(
    url: str, pid: int, tokens: int, concurrency: int, requests_per_worker: int
) -> tuple[float, float, float, float, float]:
    """(tokens per wall second, tokens per server CPU second, mean, p50 and p99 latency s) with
    `concurrency` clients each sending requests back to back."""
    body = {
        "model": "policy", "messages": PROMPT, "max_tokens": tokens, "ignore_eos": True,
        "return_token_ids": True, "logprobs": True,
    }  # fmt: skip
    latencies: list[float] = []
    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=httpx.Limits(max_connections=max(64, concurrency))
    ) as client:
        await client.post("/v1/chat/completions", json=body)  # warm-up

        async def worker() -> int:
            produced = 0
            for _ in range(requests_per_worker):
                t0 = time.perf_counter()
                reply = (await client.post("/v1/chat/completions", json=body)).json()
                latencies.append(time.perf_counter() - t0)
                produced += len(reply["choices"][0]["token_ids"])
            return produced

        wall, cpu = time.perf_counter(), process_cpu_s(pid)
        produced = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        wall, cpu = time.perf_counter() - wall, process_cpu_s(pid) - cpu
    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2], latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return produced / wall, produced / cpu, sum(latencies) / len(latencies), p50, p99


async def bench_engine(
    model_dir: str, device: str, tokens: int, concurrency: int, requests_per_worker: int
) -> tuple[float, float, float]:
    """(tokens per wall second, tokens per CPU second of this process, mean batch) of the torch
    engine itself, in this process, with the server's prompt and sampling settings but no HTTP:
    what the server could reach if its HTTP layer cost nothing."""
    from squall.inference.engines.engine import SamplingParams
    from squall.inference.engines.torch_engine import TorchEngine
    from squall.shared.config import load_config

    section = {"device": device, "max_batch": concurrency, "follow_weights": False}
    engine = TorchEngine(model_dir, load_config(env={}, overrides={"inference": section}).inference)
    await engine.start()
    try:
        text = engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
        prompt_ids = engine.tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)

        async def request() -> int:
            return sum([len(d.token_ids) async for d in engine.generate(prompt_ids, params, stream=False)])

        async def worker() -> int:
            return sum([await request() for _ in range(requests_per_worker)])

        await request()  # warm-up, as bench_server's
        before = engine.stats()
        wall, cpu = time.perf_counter(), time.process_time()
        produced = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        after = engine.stats()
    finally:
        await engine.stop()
    batch = (after["sampled_tokens"] - before["sampled_tokens"]) / max(
        1, after["forward_passes"] - before["forward_passes"]
    )
    return produced / wall, produced / cpu, batch


def start_server(
    model_dir: str,
    port: int,
    device: str,
    max_batch: int,
    backend: str = "torch",
    run_env: dict | None = None,
) -> subprocess.Popen:
    env = {
        **os.environ, "SQUALL_INFERENCE__TORCH_THREADS": "1", "SQUALL_INFERENCE__MAX_BATCH": str(max_batch),
        "SQUALL_INFERENCE__DEVICE": device, **(run_env or {}),
    }  # fmt: skip
    cmd = [sys.executable, "-m", "squall.cli", "inference", "--model", model_dir, "--port", str(port)]
    cmd += ["--backend", backend] + ([] if run_env else ["--no-follow"])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start_s = 120 if backend == "torch" else 900  # vLLM: engine core and compile first
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError("the inference server exited during start-up")
    proc.kill()
    raise TimeoutError(f"the inference server did not start within {start_s} s")


def compare_backends(
    model_dir: str, backends: list[str], levels: list[int], tokens: int, requests: int
) -> None:
    """Each backend serving `model_dir` in turn: (tok/s, p50, p99) per concurrency, reload s."""
    import hashlib

    from squall.shared import bus, schemas
    from squall.shared.keys import Keys
    from squall.shared.localredis import free_port as redis_port
    from squall.shared.redisconn import connect

    url = f"redis://127.0.0.1:{redis_port()}/0"
    r = connect(url, autostart=True)
    weights = Path(model_dir) / "model.safetensors"  # the model's own weights, as a new version
    checksum = hashlib.sha256(weights.read_bytes()).hexdigest()
    results: dict[str, dict] = {}
    for backend in backends:
        run = f"bench{backend}"
        run_env = {"SQUALL_RUN__NAME": run, "SQUALL_RUN__REDIS_URL": url, "SQUALL_RUN__AUTOSTART_REDIS": "false",
                   "SQUALL_INFERENCE__DTYPE": "float32"}  # fmt: skip
        port = free_port()
        started = time.perf_counter()
        server = start_server(model_dir, port, "cpu", max(levels), backend, run_env)
        start_s = time.perf_counter() - started
        try:
            base = f"http://127.0.0.1:{port}"
            rows = {}
            for concurrency in levels:
                per_worker = max(1, requests // concurrency)
                tps, _, _, p50, p99 = asyncio.run(
                    bench_server(base, server.pid, tokens, concurrency, per_worker)
                )
                rows[concurrency] = (tps, p50, p99)
                print(f"{backend} concurrency {concurrency}: {tps:.1f} tok/s, p50 {p50:.2f} s, p99 {p99:.2f} s",
                      flush=True)  # fmt: skip
            message = schemas.WeightVersion(
                run=run, version=1, step=1, location=str(weights), checksum=checksum
            )
            published = time.perf_counter()
            bus.publish(r, Keys(run).weights, message)
            while httpx.get(f"{base}/health", timeout=10).json()["weight_version"] != 1:
                if time.perf_counter() - published > 600:
                    raise TimeoutError(f"{backend}: version 1 not served within 600 s")
                time.sleep(0.05)
            reload_s = time.perf_counter() - published
            print(f"{backend}: start {start_s:.1f} s, reload {reload_s:.2f} s", flush=True)
            results[backend] = {"rows": rows, "reload_s": reload_s, "start_s": start_s}
        finally:
            server.terminate()
            server.wait(60)
    print(f"\n{Path(model_dir).name}, {tokens} tokens per request, CPU, float32, 1 torch thread per server")
    print("backend | concurrency | tok/s | p50 s | p99 s")
    for backend, result in results.items():
        for concurrency, (tps, p50, p99) in result["rows"].items():
            print(f"{backend} | {concurrency} | {tps:.1f} | {p50:.2f} | {p99:.2f}")
    for backend, result in results.items():
        print(
            f"{backend}: start {result['start_s']:.1f} s, reload of a full version {result['reload_s']:.2f} s"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: build the tiny model in a temp dir)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens sampled per request")
    parser.add_argument("--requests", type=int, default=128, help="requests per concurrency level (about)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating server/generate rounds (median)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda (bf16 there, on both sides)")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels, 1 first")
    parser.add_argument("--shape", help="instead of --model: a random model of this shape (e.g. qwen2-0.5b)")
    parser.add_argument(
        "--engine", action="store_true",
        help="also run the torch engine in this process without HTTP (its tok/s, tok/cpu-s, mean batch)",
    )  # fmt: skip
    parser.add_argument(
        "--backends",
        help="instead of the server-vs-generate comparison: these backends side by side (torch,vllm)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    levels = [int(v) for v in args.concurrency.split(",")]
    if args.backends:
        if not args.model:
            parser.error("--backends needs --model (a model vLLM can serve on CPU, e.g. the real model)")
        compare_backends(args.model, args.backends.split(","), levels, args.tokens, args.requests)
        return 0

    return server_vs_generate(args, levels)


def server_vs_generate(args: argparse.Namespace, levels: list[int]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from squall.inference.tiny import build_tiny_model

            model_dir = str(build_tiny_model(Path(tmp) / "tiny"))
        if args.shape:
            from squall.inference.tiny import build_shaped_model

            model_dir = str(build_shaped_model(Path(tmp) / args.shape, args.shape))
        port = free_port()
        server = start_server(model_dir, port, args.device, max(levels))
        try:
            generate = Generate(model_dir, args.device)
            url = f"http://127.0.0.1:{port}"
            rows, engine_rows = [], []
            for concurrency in levels:
                # Server and generate alternate, `rounds` times each, and medians are compared,
                # so load from other processes on the machine hits both alike.
                per_worker = max(2, args.requests // (concurrency * args.rounds))
                if concurrency == 1:
                    per_worker = max(4, args.requests // (4 * args.rounds))
                server_runs, generate_runs, engine_runs = [], [], []
                for _ in range(args.rounds):
                    server_runs.append(
                        asyncio.run(bench_server(url, server.pid, args.tokens, concurrency, per_worker))
                    )
                    generate_runs.append(generate.run(args.tokens, concurrency, 2 if concurrency > 1 else 4))
                    if args.engine:
                        engine_runs.append(
                            asyncio.run(
                                bench_engine(model_dir, args.device, args.tokens, concurrency, per_worker)
                            )
                        )
                if args.engine:
                    engine_rows.append(
                        (concurrency, *(statistics.median(r[i] for r in engine_runs) for i in range(3)))
                    )
                rows.append(
                    (
                        concurrency,
                        *(statistics.median(r[i] for r in server_runs) for i in range(5)),
                        *(statistics.median(r[i] for r in generate_runs) for i in range(2)),
                    )
                )
                print(
                    f"concurrency {concurrency}: server tok/s {rows[-1][1]:.0f}, generate tok/s {rows[-1][6]:.0f}",
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait(30)

    base = rows[0][1]
    where = args.device if args.device == "cpu" else f"{args.device} ({torch.cuda.get_device_name()}, bf16)"
    print(
        f"\n{args.tokens} tokens per request, {where}, 1 torch thread; generate = model.generate at batch = concurrency"
    )
    print("tok/s: tokens per wall second; tok/cpu-s: tokens per CPU second of the serving process")
    header = (
        "concurrency",
        "server tok/s",
        "x conc. 1",
        "mean lat s",
        "p50 lat s",
        "p99 lat s",
        "server tok/cpu-s",
        "generate tok/s",
        "generate tok/cpu-s",
    )
    print(" | ".join(header))
    print("-" * 150)
    for concurrency, tps, cpu_tps, latency, p50, p99, gen, gen_cpu in rows:
        values = (
            concurrency,
            f"{tps:.0f}",
            f"{tps / base:.2f}",
            f"{latency:.3f}",
            f"{p50:.3f}",
            f"{p99:.3f}",
            f"{cpu_tps:.0f}",
            f"{gen:.0f}",
            f"{gen_cpu:.0f}",
        )
        print(" | ".join(str(v).rjust(len(h)) for v, h in zip(values, header, strict=True)))
    if engine_rows:
        print("\nthe torch engine in the benchmark process, no HTTP (same prompt, clients back to back):")
        print("concurrency | engine tok/s | engine tok/cpu-s | mean batch | server/engine tok/cpu-s")
        for (concurrency, tps, cpu_tps, batch), row in zip(engine_rows, rows, strict=True):
            values = (concurrency, f"{tps:.0f}", f"{cpu_tps:.0f}", f"{batch:.1f}", f"{row[2] / cpu_tps:.2f}")
            print(" | ".join(str(v).rjust(w) for v, w in zip(values, (11, 12, 16, 10, 23), strict=True)))
    _, tps1, cpu1, *_, gen1, gen_cpu1 = rows[0]
    print(f"\nserver overhead at concurrency 1, wall time: {(gen1 / tps1 - 1) * 100:+.1f}% (target <= 10%)")
    print(f"server overhead at concurrency 1, CPU time:  {(gen_cpu1 / cpu1 - 1) * 100:+.1f}%")
    for concurrency, tps, *_, gen, _ in rows[1:]:
        print(f"concurrency {concurrency}: {tps / base:.2f}x concurrency 1; server/generate {tps / gen:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
