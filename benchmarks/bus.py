"""Bus benchmark: publish -> consume -> ack through a consumer group, squall's path beside
the raw redis-py path on the same bytes, in one run.

    python benchmarks/bus.py [--redis-url URL] [--small N] [--traj N] [--procs 1 4]

squall's path: producers `bus.publish_many` (encode), consumers `GroupConsumer.read`
(decode + validate, dead-letter on failure) and `ack`. Raw path: pipelined XADD of the
pre-encoded bytes, XREADGROUP and XACK with no decoding. Latency = consume time minus the
entry id's timestamp (Redis' clock at XADD), so both paths are measured the same way.
Without --redis-url a private server is started (the machine's own may hold other data).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np
import redis

from squall.shared import bus, schemas
from squall.shared.localredis import LocalRedis

BATCH = 100  # entries per pipeline / per XREADGROUP


def small_message(i: int) -> schemas.Task:
    return schemas.Task(run="bench", task_id=f"g{i}:0", group_id=f"g{i}", sample_id=str(i), index=0,
                        group_size=8, payload={"question": "What is 37 + 58?", "answer": 95}, deadline=1e10)  # fmt: skip


def trajectory_message(i: int, prompt: int = 2000, response: int = 500) -> schemas.Trajectory:
    rng = np.random.default_rng(i % 16)
    turn = schemas.Turn(model="policy", prompt_ids=schemas.pack_tokens(rng.integers(0, 150_000, prompt)),
                        response_ids=schemas.pack_tokens(rng.integers(0, 150_000, response)),
                        response_logprobs=schemas.pack_logprobs(-rng.random(response)), version=1)  # fmt: skip
    return schemas.Trajectory(run="bench", task_id=f"g{i}:0", group_id=f"g{i}", sample_id=str(i), index=0,
                              group_size=8, attempt=0, runner_id="r", status="ok", reward=1.0, turns=[turn])  # fmt: skip


def produce(url: str, stream: str, kind: str, path: str, start: int, count: int, go) -> None:
    r = redis.Redis.from_url(url)
    make = small_message if kind == "small" else trajectory_message
    messages = [make(i) for i in range(start, start + count)]
    raw = [schemas.encode(m) for m in messages] if path == "raw" else None
    go.wait()
    for lo in range(0, count, BATCH):
        if raw is None:
            bus.publish_many(r, stream, messages[lo : lo + BATCH])
        else:
            pipe = r.pipeline(transaction=False)
            for payload in raw[lo : lo + BATCH]:
                pipe.xadd(stream, {schemas.ENTRY_FIELD: payload})
            pipe.execute()


def consume(url: str, stream: str, kind: str, path: str, name: str, total: int, counter, results, go) -> None:
    r = redis.Redis.from_url(url)
    decode_as = schemas.Task if kind == "small" else schemas.Trajectory
    consumer = bus.GroupConsumer(r, stream, "g", name, kind=decode_as, deadletter_stream=stream + ":dl")
    latencies: list[float] = []
    go.wait()
    while counter.value < total:
        now_ms = time.time() * 1000
        if path == "raw":
            reply = r.xreadgroup("g", name, {stream: ">"}, count=BATCH, block=50)
            ids = [entry_id for entry_id, _ in reply[0][1]] if reply else []
            if ids:
                r.xack(stream, "g", *ids)
        else:
            ids = [d.entry_id for d in consumer.read(BATCH, 50)]
            consumer.ack(ids)
        for entry_id in ids:
            stamp = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            latencies.append(now_ms - int(stamp.split("-")[0]))
        with counter.get_lock():
            counter.value += len(ids)
    results.put(latencies)


def run_case(url: str, kind: str, path: str, procs: int, n: int) -> dict:
    r = redis.Redis.from_url(url)
    stream = f"bench:{kind}:{path}:{procs}"
    r.delete(stream)
    bus.ensure_group(r, stream, "g")
    ctx = mp.get_context("fork")
    counter, results, go = ctx.Value("l", 0), ctx.Queue(), ctx.Event()
    share = n // procs
    workers = [
        ctx.Process(target=produce, args=(url, stream, kind, path, p * share, share, go))
        for p in range(procs)
    ]
    workers += [ctx.Process(target=consume, args=(url, stream, kind, path, f"c{p}", share * procs, counter, results, go))
                for p in range(procs)]  # fmt: skip
    for w in workers:
        w.start()
    time.sleep(1.0 + 0.2 * procs)  # let producers build their messages before the clock starts
    start = time.perf_counter()
    go.set()
    latencies = [lat for _ in range(procs) for lat in results.get(timeout=600)]
    elapsed = time.perf_counter() - start
    for w in workers:
        w.join(timeout=30)
    r.delete(stream)
    latencies.sort()
    return {
        "events_s": share * procs / elapsed,
        "p50_ms": statistics.median(latencies),
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))],
    }


def packing_table() -> list[str]:
    """A 32k-token trajectory: packed binary arrays vs plain msgpack lists."""
    import msgspec

    class ListTurn(msgspec.Struct):
        prompt_ids: list[int]
        response_ids: list[int]
        response_logprobs: list[float]

    rng = np.random.default_rng(0)
    prompt, response = rng.integers(0, 150_000, 24_000), rng.integers(0, 150_000, 8_000)
    logprobs = -rng.random(8_000)
    packed = trajectory_message(0, 24_000, 8_000)
    packed.turns[0] = schemas.Turn(model="p", prompt_ids=schemas.pack_tokens(prompt), response_ids=schemas.pack_tokens(response),
                                   response_logprobs=schemas.pack_logprobs(logprobs), version=1)  # fmt: skip
    listed = ListTurn(prompt.tolist(), response.tolist(), logprobs.tolist())
    rows = []
    for label, obj, decoder in (
        ("packed int32/float32 (chosen)", packed, lambda b: schemas.decode(b, schemas.Trajectory)),
        ("msgpack lists", listed, msgspec.msgpack.Decoder(ListTurn).decode),
    ):
        raw = msgspec.msgpack.encode(obj)
        t0 = time.perf_counter()
        for _ in range(20):
            msgspec.msgpack.encode(obj)
        t1 = time.perf_counter()
        for _ in range(20):
            decoder(raw)
        t2 = time.perf_counter()
        rows.append(
            f"| {label} | {len(raw) / 1024:.0f} KiB | {(t1 - t0) / 20 * 1e3:.2f} ms | {(t2 - t1) / 20 * 1e3:.2f} ms |"
        )
    return ["| 32k-token trajectory | size | encode | decode + validate |", "|---|---|---|---|", *rows]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--redis-url")
    parser.add_argument("--small", type=int, default=40_000)
    parser.add_argument("--traj", type=int, default=4_000)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    server = None
    url = args.redis_url
    if url is None:
        server = LocalRedis().start()
        url = server.url
    print("\n".join(packing_table()))
    print()
    print(
        "| entries | procs (P producers + P consumers) | raw events/s | squall events/s | squall/raw | raw p50/p99 ms | squall p50/p99 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind, n in (("small", args.small), ("trajectory 2000+500 tok", args.traj)):
        short = "small" if kind == "small" else "traj"
        for procs in args.procs:
            raw = run_case(url, short, "raw", procs, n)
            ours = run_case(url, short, "squall", procs, n)
            print(f"| {kind} | {procs} | {raw['events_s']:,.0f} | {ours['events_s']:,.0f} | "
                  f"{ours['events_s'] / raw['events_s']:.0%} | {raw['p50_ms']:.1f} / {raw['p99_ms']:.1f} | "
                  f"{ours['p50_ms']:.1f} / {ours['p99_ms']:.1f} |", flush=True)  # fmt: skip
    if server:
        server.close()


if __name__ == "__main__":
    main()
