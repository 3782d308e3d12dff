"""A consumer process for the bus tests: drains a stream through a group, recording each
processed task_id in a hash (HINCRBY, in the same transaction as the XACK).

    python tests/busworker.py URL STREAM GROUP NAME MODE
MODE `work`: process until the `done` flag is set; reclaim entries idle > 300 ms.
MODE `hold`: read 200 entries, never ack them, then sleep (to be killed -9).
"""

from __future__ import annotations

import sys
import time

import redis

from squall.shared import bus, schemas

LEASE_MS = 300


def main() -> int:
    url, stream, group, name, mode = sys.argv[1:6]
    r = redis.Redis.from_url(url)
    consumer = bus.GroupConsumer(r, stream, group, name, kind=schemas.Task, deadletter_stream=stream + ":dl")
    if mode == "hold":
        consumer.read(count=200, block_ms=2000)
        r.set(f"{stream}:held", 1)
        time.sleep(600)
        return 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not r.exists(f"{stream}:done"):
        deliveries = consumer.read(count=100, block_ms=100) + consumer.reclaim(LEASE_MS, count=100)
        if not deliveries:
            continue
        pipe = r.pipeline(transaction=True)
        for delivery in deliveries:
            pipe.hincrby(f"{stream}:processed", delivery.message.task_id, 1)
        pipe.xack(stream, group, *[d.entry_id for d in deliveries])
        pipe.incrby(f"{stream}:count", len(deliveries))
        pipe.execute()
    return 0


if __name__ == "__main__":
    sys.exit(main())
